"""Stage 3: gather partitioned chunks just before a module runs, release them after, prefetch by trace.

Hooks: a module's forward pre-hook gathers the chunks holding its parameters (plus any registered
external parameters), the forward post-hook releases them and hooks the module's outputs so that the
same chunks are gathered again when their gradient arrives (pre-backward). During backward a chunk is
released when the gradient reducer reports all its gradients accumulated; recomputation inside
activation checkpointing is a forward run *during* backward, so nothing is released there.

Prefetch: every step records the sequence of chunk requests (forward and backward, across all
micro-batches). The next step replays it: serving request i also issues async all-gathers for the
chunks at i+1, i+2, ... not gathered yet, within ``stage3_prefetch_bucket_size`` elements in flight and
``stage3_max_live_parameters`` gathered elements, so the next module's gather overlaps this module's compute.
A request that does not match the trace turns prefetch off for the rest of the step and the step's record
becomes the new trace.
The first step has no record yet: its trace is predicted from the module order (modules in registration
order forward, in reverse backward, once per micro-batch), which is the execution order of GPT-style models,
so the first step prefetches and keeps a chunk gathered across the modules that share it like the later
ones; a model that runs in another order just turns prefetch off at the first mismatch.
A chunk whose next use is within ``stage3_max_reuse_distance`` elements of requests is kept gathered.
All ranks of the DP group make the same decisions, so their collectives stay in the same order.

Parameter shards on SSD (``offload_param.device = nvme``): a gather first reads the shard into a staging
buffer (released when the gather completes). Read-ahead: while prefetching, the SSD reads of the chunks in
the next window (another ``stage3_prefetch_bucket_size`` elements beyond the gathers in flight) are
started, so by the time a chunk's gather is issued its shard is in memory. When the trace says the chunk
is gathered again in the step (the backward after the forward) and the placement left host budget for it
(``keep_param_bytes``), the shard's buffer is kept for that gather instead of being read again; kept
shards are dropped when the parameters change.

Copies (streams.py): with an accelerator (or the emulated one), a shard that lives in host memory (or was
just read from SSD) is copied into the rank's own piece of the chunk's full buffer on the host-to-device
stream, after a compute event (the buffer may be a block compute just used), and the all-gather runs in
place, issued after that copy's event and not after the compute stream. So a prefetch's copy and gather
both overlap the current module's compute. Every all-gather of the coordinator is issued through the
streams then (``after``), so all of them keep one order on every rank. An SSD staging buffer goes back to
its pool when the copy no longer reads it (``source_free``); pending ones are polled at every fetch.

A shard group of one rank (the expert-data-parallel group when expert parallelism spans the data-parallel
ranks, or a single process) has nothing to gather: when the shard lives in compute memory in the compute dtype,
the chunk's full buffer is pointed at the shard's own memory while it is "gathered" (no copy, no second buffer,
no arena region), with the same lifecycle events as a gather. A shard in host memory behind an accelerator is
copied into the full buffer (the all-gather of that piece then does nothing), and one on SSD is read and copied.

Secondary shards (hpZ, ``zero_hpz_partition_size``): when a chunk's gather over the whole group completes, this rank
keeps its node's share of it; the chunk's later gathers in the step all-gather those shares over the node only
(``ChunkCollectives.gather_secondary``). They are dropped with the gathered copies when the parameters change. A
gather serves as the source only once it is waited for, and the next gather of a chunk is issued only after that, so
every rank of the node takes the same path. Quantized gathers (qwZ) apply to shards in compute memory; a shard
copied from host memory or SSD behind an accelerator is gathered exactly.

Arena (``max_contigous_params_size`` > 0): gathered chunks are regions of one preallocated buffer
(``param_arena.py``), and they stay there after use as a cache, valid until the parameters change (the end of
the step). A gather that does not fit evicts idle chunks by the trace, the one requested furthest in the future
first (Belady's rule; the least recently used first while there is no trace). It never allocates more. A
prefetch evicts only chunks needed after the one it fetches; a chunk in use (its module's forward is
running, or its backward has not produced all its gradients) is never evicted. The arena replaces
``stage3_max_live_parameters`` and the reuse rule as the bound on gathered memory.
"""
from __future__ import annotations

import bisect
import logging

import torch
from torch import nn

from . import storage_pointer
from .aio import round_up
from .chunk import FlatChunk
from .comm import Handle
from .config import ZeroConfigError, ZeroOptimizationConfig
from .leaf_modules import z3_leaf_module
from .lifecycle import ChunkEvents, ChunkListener
from .param_arena import ParamArena, arena_numel, region_numel
from .states import State
from .store import DEVICE, ShardStore
from .streams import HostStreams, Streams

logger = logging.getLogger(__name__)


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


class ParamCoordinator(ChunkListener):
    """Gathers and releases the partitioned chunks of ``model`` (hooks registered here) and emits their
    lifecycle events (``backward_touched``, ``may_gather``/``before_gather``) on ``events``; it hears
    ``grad_ready`` (a chunk whose gradients all exist is released)."""

    def __init__(self, model: nn.Module, chunks: list[FlatChunk], events: ChunkEvents, zcfg: ZeroOptimizationConfig,
                 store: ShardStore, streams: Streams | None = None, micro_batches: int = 1, keep_param_bytes: int = 0):
        self.chunks = chunks
        self.events = events
        self.micro_batches = micro_batches
        self.store = store
        self.streams = streams or HostStreams()
        # Partitioned chunks whose shard is in host memory (or SSD): gathers copy it to the device first.
        self.host_param = [self.streams.separate and not c.plan.resident
                           and (c.on_ssd(State.PARAM) or store.tier_of(c.key(State.PARAM)) != DEVICE)
                           for c in chunks]
        self._releases: list = []  # (event, staging buffer): SSD buffers a copy still reads
        self._copies: dict[int, object] = {}  # chunk -> done event of the copy into its full buffer
        self.ssd_reads: dict[int, object] = {}  # chunk -> SwapHandle of its parameter shard being read
        self.staged: dict[int, torch.Tensor] = {}  # chunk -> shard buffer an in-flight gather reads
        self._serves: dict[int, int] = {}  # chunk -> trace position its gather in flight serves
        self.kept: dict[int, tuple[torch.Tensor, object, int]] = {}  # chunk -> (SSD shard buffer, copy's
        # source_free, its staging bytes)
        self.keep_limit, self.kept_bytes = keep_param_bytes, 0
        self.params_on_ssd = any(c.on_ssd(State.PARAM) for c in chunks)
        # hpZ: chunk -> this rank's secondary shard (valid until the parameters change), and the gathers in
        # flight over the whole group whose result it is taken from.
        self.secondary: dict[int, torch.Tensor] = {}  # counted in gathered_bytes while kept
        self._primary: set[int] = set()
        # A shard group of one rank has nothing to gather: a chunk whose shard is in compute memory (the device,
        # the compute dtype) is "gathered" by pointing its full buffer at the shard (``FlatChunk.alias_full``).
        self.in_place = [c.comm.size == 1 and not c.plan.resident and not self.host_param[c.index]
                         and not c.on_ssd(State.PARAM) and c.param_shard is not None
                         and c.param_shard.device == c.full.device and c.param_shard.dtype == c.full.dtype
                         and storage_pointer.mechanism() is not None
                         for c in chunks]
        self.prefetch_numel = zcfg.stage3_prefetch_bucket_size
        self.max_live = zcfg.stage3_max_live_parameters
        self.max_reuse = zcfg.stage3_max_reuse_distance
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
        self.arena: ParamArena | None = None
        self.arena_numel = 0  # elements the arena holds (0: no arena); the limit is checked on every chunk
        partitioned = [c for c in chunks if not c.plan.resident]
        if zcfg.max_contigous_params_size > 0 and partitioned:
            if storage_pointer.mechanism() is None:
                logger.warning("zero_cache: max_contigous_params_size is not used, gathered chunks get allocations "
                               "of their own: %s", storage_pointer.unavailable_reason())
            else:
                self.arena_numel = arena_numel(zcfg.max_contigous_params_size, partitioned[0].full.element_size())
        gathered = [c for c in partitioned if not self.in_place[c.index]]
        if self.arena_numel > 0 and gathered:  # in-place chunks take no room in it
            self.arena = ParamArena(zcfg.max_contigous_params_size, gathered[0].full.dtype, gathered[0].full.device)
        self.pinned: set[int] = set()  # chunks a running backward still reads (until all their gradients exist)
        self._requests = 0
        self._last_use = [0] * len(chunks)  # request count at each chunk's last request (LRU order)
        self._register_model(model)

    # ---- registration -------------------------------------------------------------------------------
    def _register_model(self, model: nn.Module) -> None:
        """Hook each module that owns parameters, or a leaf module (leaf_modules.py) for all of its own and its
        descendants' (which get no hooks)."""
        inside: set[nn.Module] = set()  # the descendants of leaf modules
        for m in model.modules():
            if m in inside:
                continue
            leaf = z3_leaf_module(m)
            if leaf:
                inside.update(m.modules())
            ids = sorted({self.chunk_of[id(p)] for p in m.parameters(recurse=leaf) if id(p) in self.chunk_of})
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
        if self.arena_numel > 0:  # checked over every chunk, in place or not: the same limit on any group size
            elem = self.chunks[ids[0]].full.element_size()
            need = sum(region_numel(self.chunks[c].plan.padded, elem) for c in ids)
            if need > self.arena_numel:
                raise ZeroConfigError(
                    f"zero_cache config: 'zero_optimization.max_contigous_params_size' {self.arena_numel} elements "
                    f"cannot hold the chunks one {type(module).__name__} module uses at once ({need} elements); "
                    f"raise it to at least {need} "
                    f"(2x that lets the next chunk be prefetched) or set -1 for plain allocations")

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
        self.events.backward_touched()
        ids = self.module_chunks[module]
        self.pinned.update(ids)
        self.fetch(ids)

    # ---- gather / release -------------------------------------------------------------------------------
    def fetch(self, ids: list[int]) -> None:
        """Make ``ids`` available: issue what is missing, prefetch ahead by trace, then wait."""
        if self._releases:
            self._poll_releases()
        if self.trace is None:  # the first request of the first step
            self._set_trace(self._predicted_trace())
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
        if not self.chunks[c].on_ssd(State.PARAM) or c in self.ssd_reads or c in self.kept or c in self.secondary:
            return True
        if optional and not self.events.may_gather(c):
            return False
        self.events.before_gather(c)
        key = self.chunks[c].key(State.PARAM)
        handle = self.store.swap_in([key], for_gather=True, optional=True)
        if handle is None and not optional:
            for other in list(self.inflight):
                self._wait(other)
            handle = self.store.swap_in([key], for_gather=True)
        if handle is None:
            return False
        self.ssd_reads[c] = handle
        return True

    def _issue(self, c: int, at: int | None = None) -> bool:
        """Start gathering chunk ``c``: a demand fetch, or a prefetch of trace position ``at``, which gives up
        (False) when the arena has no room for it or the chunk's update is still running."""
        chunk = self.chunks[c]
        # A prefetch does not wait for an update still running (the overlapped step): it leaves the chunk to its
        # demand fetch. The gathers keep the trace's order either way, and the update runs only in the forward
        # after the step, before any other collective of the group, so every rank issues the same sequence.
        if at is not None and not self.events.may_gather(c):
            return False
        if c in self.secondary:
            return self._issue_secondary(c, at)
        if self.in_place[c]:
            self.events.before_gather(c)
            chunk.alias_full(chunk.param_shard)
            chunk.gathered = True
            return True
        if self.arena is None:
            chunk.allocate_full()
        elif not self._make_room(c, at):
            return False
        self.events.before_gather(c)
        src = chunk.param_shard
        if chunk.on_ssd(State.PARAM):
            self._serves[c] = self.pos - 1 if at is None else at  # the trace position this gather serves
            if c in self.kept:
                src = self._unkeep(c)[0]
            else:
                self._read_ahead(c, optional=False)
                (src,) = self.ssd_reads.pop(c).wait()
            self.staged[c] = src
        if self.host_param[c]:
            piece = chunk.shard_of_full()
            copy = self.streams.h2d(piece, src, after=(self.streams.compute_event(),))
            self._copies[c] = copy.done
            if c in self.staged:
                buf = self.staged.pop(c)
                if not self._keep(c, buf, copy.source_free):
                    self._release_after(buf, copy.source_free)
            self.inflight[c] = chunk.comm.all_gather(chunk.full, piece, tag=f"chunk{c}", async_op=True,
                                                    after=copy.done)
        else:
            if src.device != chunk.full.device:
                src = src.to(chunk.full.device, non_blocking=True)
            # Issued through the streams as the copied chunks are (one order on every rank), after the compute
            # stream: the shard was written, and the buffer may have been used, by kernels queued before.
            after = self.streams.compute_event() if self.streams.separate else None
            self.inflight[c] = chunk.collectives.gather(chunk.full, src, tag=f"chunk{c}", after=after)
        if chunk.collectives.secondary:
            self._primary.add(c)
        self._count_gathered(chunk)
        return True

    def _issue_secondary(self, c: int, at: int | None) -> bool:
        """hpZ: gather chunk ``c`` from the secondary shards its node's ranks kept this step."""
        chunk = self.chunks[c]
        if self.arena is None:
            chunk.allocate_full()
        elif not self._make_room(c, at):
            return False
        self.events.before_gather(c)
        after = self.streams.compute_event() if self.streams.separate else None
        self.inflight[c] = chunk.collectives.gather_secondary(chunk.full, self.secondary[c], tag=f"chunk{c}",
                                                              after=after)
        self._count_gathered(chunk)
        return True

    def _count_gathered(self, chunk: FlatChunk) -> None:
        self.live_numel += chunk.plan.padded
        self.gathered_bytes += chunk.full_nbytes()
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def _release_after(self, buf: torch.Tensor, event) -> None:
        """Give an SSD staging buffer back once ``event`` (its copy no longer reads it) is done."""
        if event.query():
            self.store.release([buf], clean=True)
        else:
            self._releases.append((event, buf))

    def _poll_releases(self, wait: bool = False) -> None:
        keep = []
        for event, buf in self._releases:
            if wait:
                self.streams.synchronize(event)
            if event.query():
                self.store.release([buf], clean=True)
            else:
                keep.append((event, buf))
        self._releases = keep

    def _make_room(self, c: int, at: int | None) -> bool:
        """Place chunk ``c`` in the arena, evicting by the trace. A demand fetch whose chunks in use fill the
        arena first waits for the gathers in flight (they become evictable), then fails with an error."""
        waited = False
        while not self.arena.place(self.chunks[c]):
            victim = self._victim(c, at)
            if victim is not None:
                self._free(victim)
            elif at is not None:
                return False
            elif self.inflight and not waited:
                for other in list(self.inflight):
                    self._wait(other)
                waited = True
            else:
                in_use = sum(length for _, length in self.arena.region.values())
                raise RuntimeError(
                    f"max_contigous_params_size {self.arena.numel} elements: chunk {c} "
                    f"({self.arena.need(self.chunks[c])} elements) does not fit beside the {in_use} elements of "
                    f"chunks in use ({self.arena.largest_free()} free in one piece); raise it or set -1")
        return True

    def _victim(self, c: int, at: int | None) -> int | None:
        """The placed chunk to evict for ``c``: idle, and requested furthest in the future (least recently used
        on ties); for a prefetch of position ``at``, only a chunk not needed before it."""
        best, best_key = None, None
        for k in self.arena.region:
            if k == c or k in self.inflight or self.users[k] > 0 or k in self.pinned:
                continue
            nxt = self._next_use(k)
            if at is not None and nxt <= at:
                continue
            key = (nxt, -self._last_use[k])
            if best_key is None or key > best_key:
                best, best_key = k, key
        return best

    def _next_use(self, c: int) -> float:
        """Trace position of ``c``'s next request (infinity: none, or no trace to go by)."""
        if self.trace is None or not self.trace_ok:
            return float("inf")
        positions = self._trace_pos_of.get(c, [])
        k = bisect.bisect_left(positions, self.pos)
        return positions[k] if k < len(positions) else float("inf")

    def _wait(self, c: int) -> None:
        h = self.inflight.pop(c, None)
        if h is not None:
            h.wait()
            self.chunks[c].gathered = True
            if c in self._primary:  # hpZ: keep this rank's secondary shard for the step's later gathers
                self._primary.discard(c)
                lo, hi = self.chunks[c].collectives.secondary_range(self.chunks[c].plan.padded)
                self.secondary[c] = self.chunks[c].full[lo:hi].clone()
                self.gathered_bytes += self.secondary[c].nbytes
                self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)
        if c in self.staged:
            buf = self.staged.pop(c)
            if not self._keep(c, buf, None):
                self.store.release([buf], clean=True)  # unchanged: the store may cache it for the optimizer

    def _keep(self, c: int, buf: torch.Tensor, source_free) -> bool:
        """Keep chunk ``c``'s SSD shard buffer for its next gather in this step, if the trace has one and the
        keep budget holds it."""
        nbytes = round_up(buf.numel() * buf.element_size())
        served = self._serves.pop(c, None)
        positions = self._trace_pos_of.get(c, [])
        again = (served is not None and self.trace is not None and self.trace_ok
                 and bisect.bisect_right(positions, served) < len(positions))
        if not again or self.kept_bytes + nbytes > self.keep_limit:
            return False
        self.kept[c] = (buf, source_free, nbytes)
        self.kept_bytes += nbytes
        return True

    def _unkeep(self, c: int) -> tuple[torch.Tensor, object]:
        buf, source_free, nbytes = self.kept.pop(c)
        self.kept_bytes -= nbytes
        return buf, source_free

    def grad_ready(self, c: int) -> None:
        """All of chunk ``c``'s gradients of this backward pass exist: no module using it is running (this is
        called from a gradient hook), so a user count left by a recomputation that activation checkpointing
        stopped early (torch's default: the post-forward hook never runs) is cleared, and ``c`` released."""
        self.users[c] = 0
        self.pinned.discard(c)
        self.maybe_release(c)

    def maybe_release(self, c: int) -> None:
        chunk = self.chunks[c]
        if (self.arena is not None or chunk.plan.resident or self.users[c] > 0 or not chunk.gathered
                or self._reused_soon(c)):
            return  # the arena keeps chunks cached until evicted
        self._free(c)

    def _free(self, c: int) -> None:
        chunk = self.chunks[c]
        landed = self._copies.pop(c, None)
        if landed is not None:  # memory is given back only once the copy into it is done
            self.streams.before_free(landed)
        if chunk.aliased:  # the shard's own memory: nothing was gathered
            chunk.free_full()
            return
        if self.arena is not None:
            self.arena.remove(chunk)
            chunk.gathered = False
        else:
            chunk.free_full()
        self.live_numel -= chunk.plan.padded
        self.gathered_bytes -= chunk.full_nbytes()

    def release_idle(self) -> None:
        """End of a backward pass: release every gathered chunk nobody is using (reuse rule applies)."""
        self.pinned.clear()
        for c in range(len(self.chunks)):
            self.maybe_release(c)

    def drop_gathered(self) -> None:
        """The parameters are about to change (optimizer step, checkpoint load): free every gathered copy."""
        for c in list(self.inflight):
            self._wait(c)
        for c in list(self.ssd_reads):  # read ahead for a step that went another way
            self.store.release(self.ssd_reads.pop(c).wait(), clean=True)
        for c in list(self.kept):  # the shards are about to change
            buf, source_free = self._unkeep(c)
            if source_free is None:
                self.store.release([buf], clean=True)
            else:
                self._release_after(buf, source_free)
        self._poll_releases(wait=True)
        self.gathered_bytes -= sum(t.nbytes for t in self.secondary.values())
        self.secondary.clear()  # hpZ: the next gathers run over the whole group again
        self.users = [0] * len(self.chunks)
        self.pinned.clear()
        for c, chunk in enumerate(self.chunks):
            if not chunk.plan.resident and chunk.gathered:
                self._free(c)

    def end_step(self) -> None:
        """Before the optimizer step: drop every gathered copy and settle the trace for the next step."""
        self.drop_gathered()
        if self.trace is None or not self.trace_ok or self.pos != len(self.trace):
            self._set_trace(self.recording)
        self.recording = []
        self.pos = 0
        self.trace_ok = True

    # ---- trace -----------------------------------------------------------------------------------------
    def _predicted_trace(self) -> list[int]:
        """The requests of a step if modules run in registration order and their backward in reverse."""
        order = list(self.module_chunks.values())
        forward = [c for ids in order for c in ids]
        backward = [c for ids in reversed(order) for c in ids]
        return (forward + backward) * self.micro_batches

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
        self._requests += 1
        self._last_use[c] = self._requests
        if self.trace is not None and self.trace_ok:
            if self.pos < len(self.trace) and self.trace[self.pos] == c:
                self.pos += 1
            else:
                self.trace_ok = False

    def _prefetch(self) -> None:
        if self.trace is None or not self.trace_ok or self.prefetch_numel <= 0:
            return
        # The window ahead holds at most prefetch_numel elements still to come: the gathers in flight and the
        # ones issued now. Chunks already gathered take none of it (as in DeepSpeed, only parameters not yet
        # available count), so the backward's later requests of the chunk it is working on do not stop the
        # gather of the next one.
        budget = self.prefetch_numel
        seen = set()
        gathering = True  # first window: gathers; second window: SSD reads only
        for i in range(self.pos, len(self.trace)):
            c = self.trace[i]
            chunk = self.chunks[c]
            if c in seen or self.users[c] > 0 or chunk.gathered:
                continue
            seen.add(c)
            if chunk.plan.padded > budget:
                if not gathering or not self.params_on_ssd:
                    return
                gathering, budget = False, self.prefetch_numel
                if chunk.plan.padded > budget:
                    return
            budget -= chunk.plan.padded
            if c in self.inflight:
                continue
            if not gathering:
                if not self._read_ahead(c):
                    return  # staging reserve full: read the rest when gathers release buffers
            elif ((self.arena is None and self.live_numel + chunk.plan.padded > self.max_live)
                  or not self._issue(c, at=i)):
                gathering, budget = False, self.prefetch_numel  # no room to gather: read ahead only

    def _reused_soon(self, c: int) -> bool:
        """True when the trace says ``c`` is requested again within ``stage3_max_reuse_distance`` elements."""
        if self.trace is None or not self.trace_ok or self.live_numel > self.max_live:
            return False
        positions = self._trace_pos_of.get(c, [])
        k = bisect.bisect_left(positions, self.pos)
        if k == len(positions):
            return False
        return self._trace_prefix[positions[k]] - self._trace_prefix[self.pos] <= self.max_reuse
