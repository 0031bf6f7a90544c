"""Stage 3: gather partitioned chunks just before a module runs, release them after, prefetch by trace.

Hooks: a module's forward pre-hook gathers the chunks holding its parameters (plus any registered
external parameters), the forward post-hook releases them and hooks the module's outputs so that the
same chunks are gathered again when their gradient arrives (pre-backward). During backward a chunk is
released when the gradient reducer reports all its gradients accumulated; recomputation inside
activation checkpointing is a forward run *during* backward, so nothing is released there.

Prefetch: every step records the sequence of chunk requests (forward and backward, across all
micro-batches). The next step replays it: serving request i also issues async all-gathers for the
chunks at i+1, i+2, ... within ``stage3_prefetch_bucket_size`` elements and ``stage3_max_live_parameters``
gathered elements, so the next module's gather overlaps this module's compute. A request that does not
match the trace turns prefetch off for the rest of the step and the step's record becomes the new trace.
A chunk whose next use is within ``stage3_max_reuse_distance`` elements of requests is kept gathered.
All ranks of the DP group make the same decisions, so their collectives stay in the same order.

Parameter shards on SSD (``offload_param.device = nvme``): a gather first reads the shard into a staging
buffer (released when the gather completes). Read-ahead: while prefetching, the SSD reads of the chunks in
the next window (another ``stage3_prefetch_bucket_size`` elements beyond the gathers in flight) are
started, so by the time a chunk's gather is issued its shard is in memory.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch
from torch import nn

from .comm import Comm, Handle
from .config import ZeroConfig
from .partition import FlatChunk
from .store import ShardStore


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class ParamCoordinator:
    def __init__(self, chunks: list[FlatChunk], comm: Comm, zcfg: ZeroConfig,
                 on_backward_activity: Callable[[], None], store: ShardStore | None = None):
        self.chunks = chunks
        self.store = store
        self.ssd_reads: dict[int, object] = {}  # chunk -> SwapHandle of its parameter shard being read
        self.staged: dict[int, torch.Tensor] = {}  # chunk -> shard buffer an in-flight gather reads
        self.params_on_ssd = any("param" in c.swapped for c in chunks)
        self.comm = comm
        self.prefetch_numel = zcfg.stage3_prefetch_bucket_size
        self.max_live = zcfg.stage3_max_live_parameters
        self.max_reuse = zcfg.stage3_max_reuse_distance
        self.on_backward_activity = on_backward_activity
        self.chunk_of = {id(s.param): c.index for c in chunks if not c.plan.resident for s in c.plan.slots}
        self.module_chunks: dict[nn.Module, list[int]] = {}
        self.users = [0] * len(chunks)  # modules whose forward is running, per chunk
        self.inflight: dict[int, Handle] = {}
        self.live_numel = 0  # elements gathered or being gathered
        self.gathered_bytes = 0
        self.gathered_peak = 0
        self.trace: list[int] | None = None
        self._trace_pos_of: dict[int, list[int]] = {}
        self._trace_prefix: list[int] = []
        self.recording: list[int] = []
        self.pos = 0
        self.trace_ok = True
        self._hooks = []

    # ---- registration -------------------------------------------------------------------------------
    def register_model(self, model: nn.Module) -> None:
        for m in model.modules():
            ids = sorted({self.chunk_of[id(p)] for p in m.parameters(recurse=False) if id(p) in self.chunk_of})
            if ids:
                self._attach(m, ids)

    def add_external(self, module: nn.Module, param: nn.Parameter) -> None:
        if id(param) not in self.chunk_of:
            return  # resident parameters are always available
        ids = sorted(set(self.module_chunks.get(module, [])) | {self.chunk_of[id(param)]})
        self._attach(module, ids)

    def _attach(self, module: nn.Module, ids: list[int]) -> None:
        if module not in self.module_chunks:
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(module.register_forward_hook(self._post_forward))
        self.module_chunks[module] = ids

    # ---- hooks ------------------------------------------------------------------------------------------
    def _pre_forward(self, module, args):
        ids = self.module_chunks[module]
        for c in ids:
            self.users[c] += 1
        self.fetch(ids)

    def _post_forward(self, module, args, output):
        ids = self.module_chunks[module]
        for c in ids:
            self.users[c] -= 1
        if in_backward():  # recomputation: the backward that follows still needs the chunks
            return output
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, m=module: self._pre_backward(m))
        for c in ids:
            self.maybe_release(c)
        return output

    def _pre_backward(self, module):
        self.on_backward_activity()
        self.fetch(self.module_chunks[module])

    # ---- gather / release -------------------------------------------------------------------------------
    def fetch(self, ids: list[int]) -> None:
        """Make ``ids`` available: issue what is missing, prefetch ahead by trace, then wait."""
        for c in ids:
            self._record(c)
            if not self.chunks[c].gathered and c not in self.inflight:
                self._issue(c)
        self._prefetch()
        for c in ids:
            self._wait(c)

    def _read_ahead(self, c: int, optional: bool = True) -> bool:
        """Start reading chunk ``c``'s parameter shard from SSD. Read-ahead is skipped (False) when the
        staging reserve is full; a read the gather needs now first waits for the gathers in flight, whose
        staging buffers are then released."""
        if "param" not in self.chunks[c].swapped or c in self.ssd_reads:
            return True
        key = self.chunks[c].state_key("param")
        handle = self.store.swap_in([key], for_gather=True, optional=True)
        if handle is None and not optional:
            for other in list(self.inflight):
                self._wait(other)
            handle = self.store.swap_in([key], for_gather=True)
        if handle is None:
            return False
        self.ssd_reads[c] = handle
        return True

    def _issue(self, c: int) -> None:
        chunk = self.chunks[c]
        chunk.allocate_full()
        src = chunk.param_shard
        if "param" in chunk.swapped:
            self._read_ahead(c, optional=False)
            (src,) = self.ssd_reads.pop(c).wait()
            self.staged[c] = src
        if src.device != chunk.full.device:
            src = src.to(chunk.full.device, non_blocking=True)
        self.inflight[c] = self.comm.all_gather(chunk.full, src, tag=f"chunk{c}", async_op=True)
        self.live_numel += chunk.plan.padded
        self.gathered_bytes += chunk.full_nbytes()
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def _wait(self, c: int) -> None:
        h = self.inflight.pop(c, None)
        if h is not None:
            h.wait()
            self.chunks[c].gathered = True
        if c in self.staged:
            self.store.release([self.staged.pop(c)])

    def chunk_done(self, c: int) -> None:
        """All of chunk ``c``'s gradients of this backward pass exist: no module using it is running (this is
        called from a gradient hook), so a user count left by a recomputation that activation checkpointing
        stopped early (torch's default: the post-forward hook never runs) is cleared, and ``c`` released."""
        self.users[c] = 0
        self.maybe_release(c)

    def maybe_release(self, c: int) -> None:
        chunk = self.chunks[c]
        if chunk.plan.resident or self.users[c] > 0 or not chunk.gathered or self._reused_soon(c):
            return
        self._free(c)

    def _free(self, c: int) -> None:
        chunk = self.chunks[c]
        chunk.free_full()
        self.live_numel -= chunk.plan.padded
        self.gathered_bytes -= chunk.full_nbytes()

    def release_idle(self) -> None:
        """End of a backward pass: release every gathered chunk nobody is using (reuse rule applies)."""
        for c in range(len(self.chunks)):
            self.maybe_release(c)

    def end_step(self) -> None:
        """Before the optimizer step: drop every gathered copy and settle the trace for the next step."""
        for c in list(self.inflight):
            self._wait(c)
        for c in list(self.ssd_reads):  # read ahead for a step that went another way
            self.store.release(self.ssd_reads.pop(c).wait())
        self.users = [0] * len(self.chunks)
        for c, chunk in enumerate(self.chunks):
            if not chunk.plan.resident and chunk.gathered:
                self._free(c)
        if self.trace is None or not self.trace_ok or self.pos != len(self.trace):
            self._set_trace(self.recording)
        self.recording = []
        self.pos = 0
        self.trace_ok = True

    # ---- trace -----------------------------------------------------------------------------------------
    def _set_trace(self, trace: list[int]) -> None:
        self.trace = trace
        self._trace_pos_of = {}
        for i, c in enumerate(trace):
            self._trace_pos_of.setdefault(c, []).append(i)
        self._trace_prefix = [0]
        for c in trace:
            self._trace_prefix.append(self._trace_prefix[-1] + self.chunks[c].plan.padded)

    def _record(self, c: int) -> None:
        self.recording.append(c)
        if self.trace is not None and self.trace_ok:
            if self.pos < len(self.trace) and self.trace[self.pos] == c:
                self.pos += 1
            else:
                self.trace_ok = False

    def _prefetch(self) -> None:
        if self.trace is None or not self.trace_ok or self.prefetch_numel <= 0:
            return
        # The window ahead holds at most prefetch_numel elements, counting chunks already fetched ahead.
        budget = self.prefetch_numel
        seen = set()
        gathering = True  # first window: gathers; second window: SSD reads only
        for i in range(self.pos, len(self.trace)):
            c = self.trace[i]
            chunk = self.chunks[c]
            if c in seen or self.users[c] > 0:
                continue
            seen.add(c)
            if chunk.plan.padded > budget:
                if not gathering or not self.params_on_ssd:
                    return
                gathering, budget = False, self.prefetch_numel
                if chunk.plan.padded > budget:
                    return
            budget -= chunk.plan.padded
            if chunk.gathered or c in self.inflight:
                continue
            if not gathering:
                if not self._read_ahead(c):
                    return  # staging reserve full: read the rest when gathers release buffers
            elif self.live_numel + chunk.plan.padded > self.max_live:
                gathering, budget = False, self.prefetch_numel
            else:
                self._issue(c)

    def _reused_soon(self, c: int) -> bool:
        """True when the trace says ``c`` is requested again within ``stage3_max_reuse_distance`` elements."""
        if self.trace is None or not self.trace_ok or self.live_numel > self.max_live:
            return False
        positions = self._trace_pos_of.get(c, [])
        k = bisect.bisect_left(positions, self.pos)
        if k == len(positions):
            return False
        return self._trace_prefix[positions[k]] - self._trace_prefix[self.pos] <= self.max_reuse
