"""Data-parallel wrapper: one contiguous gradient buffer, bucketed all-reduce overlapped with backward.

Every trainable parameter gets ``param.main_grad``, a view into one flat buffer.
When a parameter's dtype equals the buffer's (fp32 training), ``param.grad`` *is*
that view, so autograd accumulates straight into the buffer and no second
gradient copy exists. 16-bit parameters get their gradient added into the fp32
buffer by a post-accumulate hook, which then frees ``param.grad``. Linear and
embedding layers with gradient-accumulation fusion add their weight gradient
into ``main_grad`` themselves (zero_cache/weight_grad.py): autograd allocates
none for them.

The buffer is laid out in reverse parameter order (roughly the order backward
produces gradients) and cut into buckets of about ``bucket_size`` elements. On
the last micro-batch of a step, a bucket's all-reduce is launched asynchronously
as soon as all of its parameters have their gradient, so communication overlaps
the rest of backward; ``finish_grad_sync()`` waits for all of them.

A backward outside ``no_sync()`` marks the gradients it produces as final.
Under the interleaved pipeline schedule the module holds several model chunks
whose last backwards of a step come at different times (the last chunk's first):
each runs outside ``no_sync()``, and a bucket is launched once every parameter
in it has had its final gradient, wherever the chunk boundaries fall. Buckets
launch in buffer order, which is the order the chunks finish (the buffer is
laid out in reverse parameter order); ``finish_grad_sync()`` launches any left.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from zero_cache.weight_grad import add_into, set_weight_grad_sink


def is_expert_param(param: torch.Tensor) -> bool:
    """A mixture-of-experts weight (Megatron-core marks them ``allreduce = False``): its replicas are the
    expert-data-parallel ranks, not the whole data-parallel group."""
    return getattr(param, "allreduce", True) is False


class GradBucket:
    """Consecutive parameters whose gradients are all-reduced together as one slice of the buffer."""

    def __init__(self, params: list[nn.Parameter], grad_data: torch.Tensor, group: dist.ProcessGroup | None):
        self.params = params
        self.grad_data = grad_data
        self.group = group  # the data-parallel group, or the expert-data-parallel one for expert weights
        self.param_ids = {id(p) for p in params}
        self.ready: set[int] = set()  # ids of params whose last-micro-batch gradient has arrived
        self.launched = False
        self.handle: dist.Work | None = None

    def reset(self) -> None:
        self.ready.clear()
        self.launched = False
        self.handle = None


class DistributedDataParallel(nn.Module):
    """Wraps ``module``; gradients are averaged over ``data_parallel_group`` (None: a single process).

    Expert weights (``is_expert_param``) are summed over ``expert_data_parallel_group`` instead and divided by
    the data-parallel size as well: each expert saw tokens from the whole data-parallel group, so that is the
    mean gradient (Megatron-core's rule). They sit in buckets of their own.

    Per step: run the micro-batches' backwards inside ``no_sync()`` except the
    last one that reaches each parameter (the step's last, or each model chunk's
    last under the interleaved schedule), then call ``finish_grad_sync()`` before
    the optimizer step, and ``zero_grad_buffer()`` (or the optimizer's
    ``zero_grad()``) before the next.
    """

    def __init__(self, module: nn.Module, data_parallel_group: dist.ProcessGroup | None,
                 bucket_size: int = 40_000_000, grad_dtype: torch.dtype = torch.float32,
                 overlap_grad_reduce: bool = True, expert_data_parallel_group: dist.ProcessGroup | None = None):
        super().__init__()
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 element (got {bucket_size})")
        self.module = module
        self.data_parallel_group = data_parallel_group
        self.dp_size = 1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
        self.expert_data_parallel_group = expert_data_parallel_group or data_parallel_group
        self.overlap_grad_reduce = overlap_grad_reduce
        self.is_last_microbatch = True
        self._next_bucket = 0  # buckets before this index have their all-reduce launched

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # shared params listed once
        self._names = {id(p): n for n, p in named}
        params = [p for _, p in named]
        self._check_params(params, grad_dtype)
        device = params[0].device if params else torch.device("cpu")
        self.grad_buffer = torch.zeros(sum(p.numel() for p in params), dtype=grad_dtype, device=device)
        self.buckets = self._build_buckets(params, bucket_size)
        self._bucket_of = {pid: b for b in self.buckets for pid in b.param_ids}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_accumulated) for p in params]
        self.broadcast_params()

    # ----- construction -----
    def _check_params(self, params: list[nn.Parameter], grad_dtype: torch.dtype) -> None:
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"parameters are spread over devices {sorted(map(str, devices))}; move the module to "
                             "one device before wrapping it in DistributedDataParallel")
        for p in params:
            name = self._names[id(p)]
            if hasattr(p, "main_grad"):
                raise ValueError(f"parameter {name} already has a main_grad: the module is wrapped in "
                                 "DistributedDataParallel twice; wrap it once")
            if p.dtype != grad_dtype and torch.finfo(grad_dtype).bits < torch.finfo(p.dtype).bits:
                raise ValueError(f"grad_dtype {grad_dtype} is less precise than parameter {name} ({p.dtype}); "
                                 "use grad_dtype=torch.float32")

    def _group_of(self, p: nn.Parameter) -> dist.ProcessGroup | None:
        return self.expert_data_parallel_group if is_expert_param(p) else self.data_parallel_group

    def _build_buckets(self, params: list[nn.Parameter], bucket_size: int) -> list[GradBucket]:
        buckets, members, start, offset = [], [], 0, 0

        def close() -> None:
            nonlocal members, start
            buckets.append(GradBucket(members, self.grad_buffer[start:offset], self._group_of(members[0])))
            members, start = [], offset

        for p in reversed(params):  # backward produces the last parameters' gradients first
            if members and is_expert_param(p) != is_expert_param(members[0]):
                close()  # a bucket is reduced over one group
            p.main_grad = self.grad_buffer[offset:offset + p.numel()].view_as(p)
            if p.dtype == self.grad_buffer.dtype:
                p.grad = p.main_grad  # autograd accumulates into the buffer in place: no second copy
            # The sink holds main_grad, not the parameter, so that the sink table does not keep it alive.
            set_weight_grad_sink(p, add_into(p.main_grad))
            members.append(p)
            offset += p.numel()
            if offset - start >= bucket_size:
                close()
        if members:
            close()
        return buckets

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Make every data-parallel replica start from data-parallel rank 0's weights."""
        if self.dp_size == 1:
            return
        for p in self.module.parameters():
            group = self._group_of(p)
            if dist.get_world_size(group) > 1:
                dist.broadcast(p.data, group=group, group_src=0)

    # ----- backward hook -----
    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        name = self._names[id(param)]
        if bucket.launched:
            raise RuntimeError(
                f"gradient of {name} arrived after its bucket's all-reduce was launched: either the previous step's "
                "gradients were not cleared (call zero_grad_buffer() or optimizer.zero_grad() before backward), or "
                "the parameter received two gradients in one backward (use torch.utils.checkpoint with "
                "use_reentrant=False)")
        if param.dtype == self.grad_buffer.dtype:
            if param.grad is None or param.grad.data_ptr() != param.main_grad.data_ptr():
                raise RuntimeError(f"gradient of {name} no longer lives in the DDP grad buffer (was .grad set to "
                                   "None, e.g. by module.zero_grad()?); clear gradients with zero_grad_buffer() "
                                   "or optimizer.zero_grad() instead")
        elif param.grad is not None:  # None: a fused linear layer added all of it into main_grad
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.is_last_microbatch and self.overlap_grad_reduce:
            bucket.ready.add(id(param))
            self._launch_next_buckets(only_ready=True)

    def _launch_next_buckets(self, only_ready: bool) -> None:
        """Launch in bucket order, so every data-parallel rank issues its collectives in the same order."""
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if only_ready and len(bucket.ready) < len(bucket.param_ids):
                return
            if self.dp_size > 1:
                bucket.grad_data.div_(self.dp_size)  # sum of (grad / dp) = data-parallel mean
                if dist.get_world_size(bucket.group) > 1:
                    bucket.handle = dist.all_reduce(bucket.grad_data, group=bucket.group, async_op=True)
            bucket.launched = True
            self._next_bucket += 1

    # ----- step protocol -----
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate (all micro-batches of a step but the last that reaches each
        parameter)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Launch the all-reduce of every bucket not launched yet (e.g. parameters that got no gradient)."""
        self._launch_next_buckets(only_ready=False)

    def finish_grad_sync(self) -> None:
        """After the step's last backward: every ``main_grad`` holds the data-parallel mean gradient."""
        self.start_grad_sync()
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None

    def zero_grad_buffer(self) -> None:
        """Zero all gradients (one memset of the buffer) and get ready for the next step."""
        for bucket in self.buckets:
            if bucket.handle is not None:  # never zero a slice a collective is still writing into
                bucket.handle.wait()
            bucket.reset()
        self._next_bucket = 0
        self.grad_buffer.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the shared buffer, so they are zeroed, never set to None."""
        self.zero_grad_buffer()

    # ----- transparent wrapper -----
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's keys, without a ``module.`` prefix (checkpoints do not depend on the wrapper)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
