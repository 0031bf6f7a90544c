"""Adam/AdamW over this rank's shards, one sub-group at a time, with torch's fused (vectorised) kernel.

Sub-groups are consecutive chunks of one parameter group holding at most ``sub_group_size`` shard
elements; their tensors live in one tier, so each sub-group is a single ``torch._fused_adamw_`` call
(the CPU kernel behind ``torch.optim.AdamW(fused=True)``). Unscaling and clipping are folded into the
kernel's ``grad_scale``. With ``pipeline_optimizer`` the write-back of sub-group i (fp32 master ->
compute-dtype parameter shard, possibly host -> device) runs on a worker thread while sub-group i+1
is updated.

Sub-groups whose states live on the SSD tier are swapped in, updated and swapped out (a gradient shard
on SSD is read with them and dropped). With
``pipeline_optimizer`` this is a three-stage pipeline on the store's I/O threads: while sub-group i is
updated, i+1 is being read (read-ahead) and i-1 written back; at most three sub-groups' staging buffers
exist at once, unless the placement gave the staging pool spare host budget: then the first sub-groups
are read ahead while the backward runs, as many as the pool holds. Without the pipeline each sub-group is
read, updated and written in turn. ``last_swap`` reports the step's optimizer I/O time (from its first
read, which may start in the backward), the time the step was blocked on it, and their difference (the
I/O hidden by compute).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .partition import FlatChunk
from .store import ShardStore


@dataclass
class GroupHParams:
    weight_decay: float


@dataclass(frozen=True)
class SwapStats:
    """SSD traffic of one optimizer step."""
    io_seconds: float  # wall time during which SSD reads/writes were in flight
    wait_seconds: float  # time the step was blocked waiting for them
    bytes_read: int
    bytes_written: int

    @property
    def hidden_seconds(self) -> float:
        return max(self.io_seconds - self.wait_seconds, 0.0)

    @property
    def overlap(self) -> float:
        """Share of the I/O time hidden behind compute (0 = fully exposed, 1 = fully hidden)."""
        return self.hidden_seconds / self.io_seconds if self.io_seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"SSD read {self.bytes_read / 2**20:.1f}MiB, wrote {self.bytes_written / 2**20:.1f}MiB, "
                f"I/O {self.io_seconds * 1e3:.1f}ms, blocked {self.wait_seconds * 1e3:.1f}ms, "
                f"hidden {100 * self.overlap:.0f}%")


class ShardedAdam:
    def __init__(self, chunks: list[FlatChunk], sub_groups: list[list[int]], groups: list[GroupHParams], *,
                 lr: float, betas: tuple[float, float], eps: float, decoupled: bool, pipeline: bool,
                 store: ShardStore | None = None):
        self.chunks = chunks
        self.sub_groups = sub_groups
        self.groups = groups
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        self.pipeline = pipeline
        self.store = store
        self.swapped = [any(self.chunks[i].opt_swapped() for i in sg) for sg in sub_groups]
        self.last_swap: SwapStats | None = None
        self._early: dict = {}  # sub-group -> its read, started before the step (see start_read_ahead)
        self.grads_on_ssd = any("grad" in c.swapped for c in chunks)

    def _swap_keys(self, k: int) -> list[tuple[FlatChunk, str]]:
        return [(self.chunks[i], name) for i in self.sub_groups[k] for name in self.chunks[i].opt_swapped()]

    def _swap_in(self, k: int, optional: bool = False):
        """Start reading sub-group ``k``: (pairs, handle), or None when ``optional`` and the pool is full."""
        pairs = self._swap_keys(k)
        handle = self.store.swap_in([c.state_key(n) for c, n in pairs], optional=optional)
        return None if handle is None else (pairs, handle)

    def start_read_ahead(self, during_backward: bool = False) -> None:
        """Start reading SSD sub-groups in step order, as many as the staging pool holds (always the first).

        Called when a backward starts (the placement gave spare host budget to the pool) and again before
        the step, while the grad norm is computed. Only with ``pipeline_optimizer``; not during a backward
        that writes gradient shards to SSD: their staging buffers come from the same pool."""
        todo = [k for k, s in enumerate(self.swapped) if s and k not in self._early]
        if not self.pipeline or not todo or (during_backward and self.grads_on_ssd):
            return
        unbounded = self.store.pool.limit is None  # then the first sub-group only
        if unbounded and self._early:
            return
        if not self._early:
            self.store.aio.busy_seconds_and_reset()
        for k in todo:
            read = self._swap_in(k, optional=bool(self._early))  # the first is needed first: never skipped
            if read is None:  # the pool is full: the step reads the rest itself
                break
            self._early[k] = read
            if unbounded:
                break

    def drop_read_ahead(self) -> None:
        """The step was skipped: hand the read-ahead buffers back."""
        for _, h in self._early.values():
            self.store.release(h.wait())
        self._early = {}

    def step(self, grad_scale: float, delayed: bool = False) -> None:
        """One update of every shard; gradients are divided by ``grad_scale`` inside the kernel.

        ``delayed`` (lock-free update, run on a background thread): read ``grad_spare`` (no zeroing: the next
        step's first reductions overwrite it, see grad_reducer.py) and write the updated parameters to
        ``pending`` instead of the parameter shards the next step reads."""
        aio = getattr(self.store, "aio", None) if any(c.swapped for c in self.chunks) else None
        if aio is not None and not self._early:
            aio.busy_seconds_and_reset()
        pool = ThreadPoolExecutor(max_workers=1) if self.pipeline else None
        futures, reads, writes = [], self._early, []
        self._early = {}
        waited = 0.0
        n = len(self.sub_groups)
        try:
            for k, sg in enumerate(self.sub_groups):
                if self.swapped[k]:
                    for j in (k, k + 1) if self.pipeline else (k,):  # read-ahead of the next sub-group
                        if j < n and self.swapped[j] and j not in reads:
                            reads[j] = self._swap_in(j)
                    pairs, handle = reads.pop(k)
                    for (c, name), t in zip(pairs, handle.wait()):
                        _set(c, name, t)
                    waited += handle.waited
                cs = [self.chunks[i] for i in sg]
                self._update(cs, grad_scale, delayed)
                todo = [c for c in cs if not c.master_is_param()]
                if delayed:
                    for c in todo:
                        c.pending.copy_(c.master)
                    todo = []
                on_ssd = [c for c in todo if "param" in c.swapped]  # bf16/fp16 parameter shards on SSD
                if on_ssd:
                    todo = [c for c in todo if "param" not in c.swapped]
                    for c in on_ssd:
                        self.store.put(c.state_key("param"), c.master)
                if self.swapped[k]:
                    _write_back(todo)  # before the master's staging buffer is handed back
                    # Gradient shards on SSD are consumed, not written back (the next step overwrites them).
                    dirty = [(c, name) for c, name in pairs if name != "grad"]
                    tensors = [_get(c, name) for c, name in dirty]
                    self.store.release([c.grad for c, name in pairs if name == "grad"])
                    for c, name in pairs:
                        _set(c, name, None)
                    writes.append(self.store.swap_out([c.state_key(nm) for c, nm in dirty], tensors))
                    while len(writes) > (1 if self.pipeline else 0):  # write-back of i-1 overlaps i
                        w = writes.pop(0)
                        w.wait()
                        waited += w.waited
                elif todo:
                    if pool is None:
                        _write_back(todo)
                    else:
                        futures.append(pool.submit(_write_back, todo))
            for w in writes:
                w.wait()
                waited += w.waited
            for f in futures:
                f.result()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            for _, h in reads.values():  # after an error: no I/O may still target a staging buffer
                if _quiet_wait(h):
                    self.store.release(h.wait())
            for w in writes:
                _quiet_wait(w)
        if aio is not None:
            io, r, w = aio.busy_seconds_and_reset()
            self.last_swap = SwapStats(io, waited, r, w)

    def _update(self, cs: list[FlatChunk], grad_scale: float, delayed: bool = False) -> None:
        masters = [c.master for c in cs]
        steps = [c.step for c in cs]
        torch._foreach_add_(steps, 1.0)
        scale = None
        if grad_scale != 1.0:
            scale = torch.tensor(grad_scale, dtype=torch.float32, device=masters[0].device)
        grads = [c.grad_spare if delayed else c.grad for c in cs]
        self.kernel(masters, grads, [c.exp_avg for c in cs], [c.exp_avg_sq for c in cs], [],
                    steps, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                    weight_decay=self.groups[cs[0].plan.group].weight_decay, eps=self.eps,
                    amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)

    def state_dict(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps}


def _get(chunk: FlatChunk, name: str) -> torch.Tensor:
    return chunk.param_shard if name == "param" else getattr(chunk, name)


def _set(chunk: FlatChunk, name: str, t: torch.Tensor | None) -> None:
    """Attach (or detach) a swapped-in state; an fp32 parameter shard on SSD is also the master."""
    if name == "param":
        chunk.param_shard = t
        chunk.master = t
    else:
        setattr(chunk, name, t)


def _write_back(chunks: list[FlatChunk]) -> None:
    for c in chunks:
        c.param_shard.copy_(c.master)


def _quiet_wait(handle) -> bool:
    """Wait for ``handle``; False if it failed (the step is already failing with the first error)."""
    try:
        handle.wait()
    except Exception:
        return False
    return True
