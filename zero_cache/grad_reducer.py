"""Gradient reduction driven by autograd hooks, so it works however backward is invoked.

Each managed parameter has a post-accumulate-grad hook. It moves the gradient into its chunk's flat
buffer and drops ``param.grad``. A layer that computes its own weight gradient hands the parameter's sink a
writer instead (weight_grad.py): the gradient lands in the buffer with no tensor in between, and the hook,
which autograd still calls (with ``param.grad`` None unless other uses of the parameter produced one), counts
the parameter as done. Two accumulation modes (docs/zero_cache/design.md):

- ``shard`` (stages 2 and 3, DeepSpeed's way): when every parameter of a chunk has its gradient for the
  current backward pass, the chunk buffer (compute dtype) is reduce-scattered asynchronously and the
  result is added into this rank's fp32 gradient shard (the step's first fp32 result is received straight
  into it). At most ``max_param_reduce_events`` reductions are in flight (0 = wait for each at once).
  With gradient accumulation and fp32 buffers, the chunks whose gradients complete last in a backward pass
  (at most ``max(1, max_param_reduce_events)``) keep their buffer until the step's last pass, which
  reduces them once: their reduce-scatters would otherwise run exposed at the end of every pass. Per-step
  memory: the 4 B/param / N shard plus the buffers of the chunks being reduced or held; communication:
  one reduce-scatter per chunk per micro-batch, one per step for the held chunks.
- ``full`` (stage 1): gradients are summed over micro-batches into full-size fp32 buffers and reduced
  once per step. Memory: 4 B/param unsharded; communication: one reduce-scatter per chunk per step.

A chunk's reduction is its ``ChunkCollectives.reduce_scatter``: one reduce-scatter over the shard group, or two
hops (inside the node, then across hosts, exact or quantized: qgZ); the handle covers both. Shards held by several
ranks (MiCS/HSDP replicas) accumulate the step's micro-batches first; ``end_step`` then all-reduces each across
its replicas once, in chunk order, before the tied groups' sums.

A shard group of one rank (a single process; the experts' group when EP equals DP) reduces nothing. In either
mode, a chunk whose fp32 gradient shard sits in the buffers' memory uses that shard as its buffer: the writers and
hooks put the step's first gradients over what it held and add the later ones, and the group's factor multiplies
it once, in the final pass (no buffer, no copy). Any other chunk of such a group (a shard on SSD or behind an
accelerator, 16-bit buffers) takes its buffer as the reduction's result.

A split backward (zero-bubble pipeline schedules) runs each micro-batch's backward in two passes. In the first,
``defer_writers`` keeps the layers' writers (with the gradients and inputs they close over) instead of running
them, and the hooks do not count those parameters; ``write_deferred`` is the second pass: it runs the writers
and counts their parameters, as the hooks would have.

The end of every backward pass (an autograd final callback) flushes chunks with only part of their
gradients (unused parameters), waits for the in-flight reductions and lets the coordinator release
gathered chunks. Every backward pass is self-contained, so 1F1B interleaving of micro-batches is fine.

With an accelerator (or the emulated one) a gradient shard that lives in host memory (or on SSD) leaves the
device as soon as its reduce-scatter completes: the result is copied on the device-to-host stream into a
pinned staging buffer while the backward of earlier layers goes on, and the host lane (host_lane.py)
accumulates it into the host shard once the copy's event is done, then hands the buffer back. Host-side
gradient work (accumulation, SSD reads and writes of gradient shards) runs on the host lane only, in order.

Norm statistics are taken as the shards become final: in the pass the engine expects to be the step's last
(``final_pass``), right after a chunk's last accumulation (on the device, or on the host lane), so when the
backward ends only the update is left. Any later change to a shard (another pass, the tied all-reduce, the
zeroing of shards without gradients) drops its statistics, which the step then computes. Shards in GPU memory
are the exception: one fused pass over all of them at the step (``norm_stats_parts``) costs a few kernel
launches instead of several per shard.

A step's first reduction of a chunk overwrites its gradient shard (so no pass zeroes the shards between
steps); a shard that got no gradient in a step is zeroed before the step.

Gradient shards on SSD (placement puts them there when the host cannot hold them): the first reduction of
a step writes ``result / N`` into a staging buffer and on to the page file (asynchronously, one write in
flight); later micro-batches read, add and write. The norm statistics of each shard are taken while it is
in memory, so the step never reads gradients just to compute the norm; the optimizer reads them with the
other states.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from .chunk import FlatChunk
from .comm import group_all_reduce
from .grad_norm import NormRanges, fused_norm_stats, sum_of_squares
from .host_lane import HostLane
from .host_memory import empty_mapped
from .lifecycle import ChunkEvents
from .partition import ParamSlot
from .states import State
from .store import DEVICE, ShardStore
from .streams import HostStreams, Streams
from .weight_grad import GradWriter, WeightGradSink, set_weight_grad_sink


def norm_stats(grad: torch.Tensor, ranges: NormRanges) -> torch.Tensor:
    """[sum of squares over ``ranges``, 1 if any element is non-finite] (float64, on the grad's device).

    A non-finite element makes the sum non-finite, so only a shard with ranges outside the norm needs its
    own scan for the overflow flag."""
    out = torch.zeros(2, dtype=torch.float64, device=grad.device)
    if ranges is None:
        out[0] = sum_of_squares(grad)
        return out
    for a, b in ranges:
        out[0] += sum_of_squares(grad[a:b])
    out[1] = (~torch.isfinite(grad)).any().double()
    return out


@dataclass(frozen=True)
class DeferredWrite:
    """A layer's weight-gradient writer that a split backward kept for its weight pass."""
    chunk: int
    slot: ParamSlot
    write: GradWriter


class GradReducer:
    """Reduces each chunk's gradients over its shard group into the gradient shards (hooks registered here) and
    emits the gradient half of the chunk lifecycle on ``events`` (lifecycle.py)."""

    def __init__(self, chunks: list[FlatChunk], events: ChunkEvents, store: ShardStore, *, mode: str,
                 max_events: int, tied_groups: dict[int, object], norm_ranges: list[NormRanges],
                 streams: Streams | None = None, lane: HostLane | None = None):
        if mode not in ("shard", "full"):
            raise ValueError(f"gradient accumulation mode must be 'shard' or 'full', got {mode!r}")
        self.chunks = chunks
        self.events = events
        self.store = store
        self.mode = mode
        self.max_events = max_events
        self.tied_groups = tied_groups  # chunk index -> process group whose members sum this chunk's grads
        self.expected = [len(c.plan.slots) for c in chunks]
        self.fired = [0] * len(chunks)
        self.buffers: dict[int, torch.Tensor] = {}
        self.written: dict[int, set[int]] = {}  # shard mode: slots of a fresh buffer that hold a gradient
        self.norm_ranges = norm_ranges
        self.on_ssd = [c.on_ssd(State.GRAD) for c in chunks]
        self.fresh = [True] * len(chunks)  # shard not written this step (holds the last step's values)
        self.ssd_stats: dict[int, torch.Tensor] = {}  # SSD shard -> norm_stats of its accumulated value
        self.ssd_writes: deque = deque()
        self.pending: deque = deque()
        self.streams = streams or HostStreams()
        self.lane = lane
        # Gradient shards outside device memory: reduce-scatter results travel to them on the D2H stream.
        self.to_host = [self.streams.separate and (self.on_ssd[i] or store.tier_of(c.key(State.GRAD)) != DEVICE)
                        for i, c in enumerate(chunks)]
        if any(self.to_host) and lane is None:
            raise ValueError("gradient shards in host memory behind an accelerator need a host lane")
        # Shards in GPU memory: their statistics come from one fused pass over all of them in the step
        # (``norm_stats_parts``), not from a few kernels per shard as each becomes final.
        self.fused = [not self.to_host[i] and not self.on_ssd[i] and c.grad.device.type == "cuda"
                      for i, c in enumerate(chunks)]
        # A shard group of one rank reduces nothing: a gradient shard that the buffer could be copied into as is
        # (fp32 compute, the same device) is itself the chunk's buffer. The layers write into it, every pass of
        # the step adds to it, and it is multiplied by the chunk's factor once, after the last.
        self.in_place = [c.comm.size == 1 and not self.to_host[i] and not self.on_ssd[i]
                         and c.grad.dtype == c.full.dtype and c.grad.device == c.full.device
                         for i, c in enumerate(chunks)]
        # MiCS / HSDP: shards held by several ranks, whose step's sum is all-reduced across them once, at the step.
        self.replicated = [c.index for c in chunks if c.collectives.replicate is not None]
        self.unscaled: set[int] = set()  # in-place shards holding this step's sum, not yet multiplied
        self.scaled: set[int] = set()  # ... multiplied in the step's final pass
        self.final_pass = False  # the engine expects the running backward pass to be the step's last
        self.stats: list[torch.Tensor | None] = [None] * len(chunks)  # norm_stats of final shards
        self.deferred: list[DeferredWrite] | None = None  # where writers go instead of running (a split backward)
        self.deferred_slots: set[tuple[int, int]] = set()  # (chunk, slot offset) whose writer this pass deferred
        # Chunk gradient buffers whose reduction finished, reused by the next chunks, in this pass and the next
        # steps' (the memory planner counts reduce buffers of the largest chunk's size), at most the buffers a
        # pass uses at once: the reductions in flight and the chunk accumulating.
        self.spare = SpareBuffers(max(c.plan.padded for c in chunks), max_events + 1)
        # Shard mode with fp32 buffers: chunks whose gradients completed in a pass that is not the step's last
        # keep their buffer, which the next passes add into, and are reduce-scattered once, in the last pass:
        # one reduction per step instead of one per micro-batch. At most max(1, max_events) are held, those
        # that completed last (the earlier ones are reduced at once, behind the backward that is still running).
        self.held: list[int] = []
        self.max_held = max(1, max_events)
        self.held_passes: dict[int, int] = {}  # chunk -> passes of this step it ended held (reductions saved)
        self.keep: set[int] = set()  # held at the end of the last such pass: they complete last, so stay held
        # A reduce-scatter result that does not land in the gradient shard itself (SSD shards, later micro-batches)
        # is added into it at once on the CPU; its buffer then serves the next such result, rather than a fresh
        # mapping that gloo's receive faults in page by page. As many are kept as a pass has in flight at once,
        # until the optimizer step (which gets the memory back).
        self.results = SpareBuffers(max(c.plan.shard for c in chunks), max_events + 1)
        self._hooks = []
        for c in chunks:
            for s in c.plan.slots:
                self._hooks.append(s.param.register_post_accumulate_grad_hook(
                    lambda p, c=c.index, s=s: self._on_grad(c, s, p)))
                # Layers that compute their own weight gradient write it into the reduction buffers.
                set_weight_grad_sink(s.param, self.weight_grad_sink(c.index, s))

    def start_pass(self, final: bool) -> None:
        """A backward pass begins; ``final``: the engine expects it to be the step's last."""
        self.final_pass = final

    def close(self) -> None:
        """Detach the weight-gradient sinks (the parameters may outlive the engine)."""
        for c in self.chunks:
            for s in c.plan.slots:
                set_weight_grad_sink(s.param, None)

    def _buffer(self, c: int) -> torch.Tensor:
        buf = self.buffers.get(c)
        if buf is None:
            chunk = self.chunks[c]
            if self.in_place[c]:
                buf = chunk.grad
                if self.fresh[c]:  # the step's first pass overwrites what the last step left
                    self.written[c] = set()
                elif c in self.scaled:  # a pass beyond the one expected to be the last adds to the plain sum
                    buf.div_(chunk.grad_factor)
                    self.scaled.discard(c)
            elif self.mode == "full":
                buf = self.store.allocate(f"c{c}.full_grad", "grads", DEVICE, chunk.plan.padded, torch.float32)
            else:  # not zeroed: the first gradient of a slot is copied in, the rest zeroed before reducing
                buf = self.spare.take(chunk.plan.padded, chunk.full.dtype, chunk.full.device)
                self.written[c] = set()
            self.buffers[c] = buf
        return buf

    def _result_buffer(self, c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Where chunk ``c``'s reduce-scatter result goes when it does not go into the shard itself."""
        numel = self.chunks[c].plan.shard
        if torch.device(device).type != "cpu" or self.to_host[c]:  # the host lane holds it until it lands
            return empty_mapped(numel, dtype, device)
        return self.results.take(numel, dtype, device)

    def _keep_result(self, out: torch.Tensor) -> None:
        """``out`` was added into its shard: keep its buffer for the next result (on the CPU only: an
        accelerator's caching allocator reuses its blocks)."""
        if out.device.type == "cpu":
            self.results.give(out)

    def weight_grad_sink(self, c: int, slot: ParamSlot) -> WeightGradSink:
        """The sink of ``slot``'s parameter (weight_grad.py): the layer's writer puts the gradient in the slot's
        region of the chunk's buffer.

        It refers to the reducer weakly, so that the sink table does not keep the model alive (the parameter's
        own gradient hook keeps the reducer alive as long as the parameter)."""
        reducer = weakref.ref(self)
        return lambda write: reducer()._on_writer(c, slot, write)

    def _region(self, c: int, slot: ParamSlot) -> tuple[torch.Tensor, bool]:
        """The slot's region of chunk ``c``'s buffer, and whether the value arriving now overwrites it (the slot's
        first gradient in a buffer that is not zeroed); the slot counts as written from here on."""
        region = self._buffer(c)[slot.offset:slot.offset + slot.numel]
        written = self.written.get(c)
        first = written is not None and slot.offset not in written
        if first:
            written.add(slot.offset)
        return region, first

    def _on_writer(self, c: int, slot: ParamSlot, write: GradWriter) -> None:
        """Write the layer's gradient into the slot's region; the parameter's hook comes after every writer."""
        self.events.backward_touched()
        if self.deferred is not None:
            self.deferred.append(DeferredWrite(c, slot, write))
            self.deferred_slots.add((c, slot.offset))
            return
        region, first = self._region(c, slot)
        write(region.view(slot.shape), first)

    def _on_grad(self, c: int, slot: ParamSlot, param: nn.Parameter) -> None:
        """Autograd's hook, once per pass after all of the parameter's gradient (None when it all went to the sink)."""
        self.events.backward_touched()
        grad = param.grad
        if grad is not None:
            param.grad = None
            region, first = self._region(c, slot)
            if first:
                region.copy_(grad.reshape(-1))
            else:
                region.add_(grad.reshape(-1))
        if (c, slot.offset) not in self.deferred_slots:  # else the pass that runs its writer counts it
            self._slot_done(c)

    def defer_writers(self, into: list[DeferredWrite] | None) -> None:
        """While ``into`` is a list, backward passes keep the layers' weight-gradient writers there, unrun."""
        self.deferred = into

    def write_deferred(self, writes: list[DeferredWrite]) -> None:
        """A pass of its own (between ``start_pass`` and ``end_backward``): run the writers one backward kept, in
        its order, then count each of their parameters as done."""
        done: dict[tuple[int, int], int] = {}
        for w in writes:
            region, first = self._region(w.chunk, w.slot)
            w.write(region.view(w.slot.shape), first)
            done[(w.chunk, w.slot.offset)] = w.chunk
        for c in done.values():
            self._slot_done(c)

    def _slot_done(self, c: int) -> None:
        """One more parameter of chunk ``c`` has all of this pass's gradient."""
        self.fired[c] += 1
        if self.fired[c] == self.expected[c]:
            if self.in_place[c]:
                self._settle(c)
            elif self.mode == "shard":
                self._complete(c)
            self.events.grad_ready(c)

    def _complete(self, c: int) -> None:
        """Chunk ``c`` has every gradient of this pass: hold its buffer for the next pass, or reduce it."""
        if self.final_pass or self.buffers[c].dtype != torch.float32:  # 16-bit buffers: accumulate in fp32 shards
            self._reduce(c)
            return
        if c not in self.held:
            self.held.append(c)
        while len(self.held) > self.max_held:
            self._reduce(next((h for h in self.held if h not in self.keep), self.held[0]))

    def _zero_unwritten(self, c: int, buf: torch.Tensor, written: set[int]) -> None:
        """Zero the padding and the parameters without a gradient in this pass (a partial flush)."""
        plan = self.chunks[c].plan
        buf[plan.numel:].zero_()
        for s in plan.slots:
            if s.offset not in written:
                buf[s.offset:s.offset + s.numel].zero_()

    def _settle(self, c: int) -> None:
        """An in-place chunk's pass is complete: its shard holds the sum so far; the final pass scales it."""
        buf = self.buffers.pop(c)
        written = self.written.pop(c, None)
        if written is not None:  # the step's first pass
            self._zero_unwritten(c, buf, written)
            self.fresh[c] = False
        self.unscaled.add(c)
        if self.final_pass:
            self._scale(c)
        self._shard_final(c, self.final_pass)

    def _scale(self, c: int) -> None:
        factor = self.chunks[c].grad_factor
        if factor != 1.0:
            self.chunks[c].grad.mul_(factor)
            self.scaled.add(c)
        self.unscaled.discard(c)

    def _reduce(self, c: int) -> None:
        if c in self.held:
            self.held.remove(c)
        buf = self.buffers.pop(c)
        self._zero_unwritten(c, buf, self.written.pop(c))
        chunk = self.chunks[c]
        # The sum of N fp16 gradients can overflow where their mean does not: an fp16 buffer is divided by N
        # before the reduce-scatter (as DeepSpeed does). fp32 and bf16 share a range wide enough for the sum
        # and are divided after it, in fp32.
        scale = chunk.grad_factor
        if buf.dtype == torch.float16 and chunk.comm.size > 1:
            buf.mul_(scale)
            scale = 1.0
        # The step's first fp32 result on the device tier is reduced straight into the gradient shard.
        direct = (self.fresh[c] and not self.to_host[c] and not self.on_ssd[c] and buf.dtype == torch.float32
                  and buf.device == chunk.grad.device)
        if chunk.comm.size == 1:  # nothing to reduce: the buffer is the result (16-bit, or bound for host or SSD)
            out, direct, handle = buf, False, None
        else:
            if direct:
                out, self.fresh[c] = chunk.grad, False
            else:
                out = self._result_buffer(c, buf.dtype, buf.device)
            handle = chunk.collectives.reduce_scatter(out, buf, tag=f"chunk{c}")
        self.pending.append((c, handle, out, buf, direct, scale))
        while len(self.pending) > self.max_events:
            self._finish()

    def _finish(self) -> None:
        c, handle, out, buf, direct, scale = self.pending.popleft()
        if handle is not None:
            handle.wait()
        final = self.final_pass
        if out is not buf:
            self.spare.give(buf)
        if direct:
            out.mul_(scale)
            self._shard_final(c, final)
        elif self.to_host[c]:  # the host lane drops ``out`` once its copy has read it
            if out is buf:
                self.spare.forget(buf)
            self._send_to_host(c, out, scale, final)
        else:
            self._accumulate(c, out, scale, self._take_fresh(c))
            if out is buf:
                self.spare.give(buf)
            else:
                self._keep_result(out)
            self._shard_final(c, final)

    def _take_fresh(self, c: int) -> bool:
        """Whether this is the step's first result of chunk ``c`` (it overwrites the shard)."""
        first, self.fresh[c] = self.fresh[c], False
        return first

    def _shard_final(self, c: int, final: bool) -> None:
        """Chunk ``c``'s shard was just accumulated; in the final pass its statistics are taken now."""
        if not final:
            self.stats[c] = None
            return
        if not self.on_ssd[c] and not self.fused[c]:
            self.stats[c] = norm_stats(self.chunks[c].grad, self.norm_ranges[c])
        self.events.grad_final(c)

    def _send_to_host(self, c: int, out: torch.Tensor, scale: float, final: bool) -> None:
        """The reduce-scatter result leaves the device now (D2H stream); the host lane accumulates it."""
        staged, landed = self.streams.d2h_staged(out, after=(self.streams.compute_event(),))
        if final:
            self.events.grad_sent(c)
        self.lane.submit(self._land, c, staged, landed, out, scale, self._take_fresh(c), final)

    def _land(self, c: int, staged: torch.Tensor, landed, out: torch.Tensor, scale: float, first: bool,
              final: bool) -> None:
        """Host lane: once the copy is done, add the result into the host (or SSD) shard."""
        try:
            self.streams.synchronize(landed)
            del out  # the copy has read it: the device block may be reused
            self.events.grad_changing(c)
            self._accumulate(c, staged, scale, first)
        finally:  # a failure raises at the next drain; the buffer must not stay lent, or the next copy waits
            self.streams.release(staged)
        self._shard_final(c, final)

    def _accumulate(self, c: int, value: torch.Tensor, scale: float, first: bool) -> None:
        """Add ``value * scale`` into chunk ``c``'s fp32 gradient shard, wherever it lives (``first``: the step's
        first result overwrites it, so no pass zeroes the shards)."""
        chunk = self.chunks[c]
        if not self.on_ssd[c]:
            _scale_into(chunk.grad, value, scale, first)
            return
        key = chunk.key(State.GRAD)
        (grad,) = self.store.staging([key]) if first else self.store.swap_in([key]).wait()
        _scale_into(grad, value, scale, first)
        self._write_ssd_grad(c, grad)

    def _write_ssd_grad(self, c: int, grad: torch.Tensor) -> None:
        self.fresh[c] = False
        self.ssd_stats[c] = norm_stats(grad, self.norm_ranges[c])
        self.ssd_writes.append(self.store.swap_out([self.chunks[c].key(State.GRAD)], [grad]))
        while len(self.ssd_writes) > 1:  # one write in flight behind the next reduction
            self.ssd_writes.popleft().wait()

    def _drain_ssd_writes(self) -> None:
        while self.ssd_writes:
            self.ssd_writes.popleft().wait()

    def end_backward(self) -> None:
        """Autograd final callback: reduce partially-filled chunks (in chunk order) and drain."""
        for c in sorted(self.buffers):
            if self.in_place[c]:
                self._settle(c)
            elif self.mode == "shard" and (c not in self.held or self.final_pass):
                self._reduce(c)
        if self.mode == "shard":
            if not self.final_pass:
                self.keep = set(self.held)
                for c in self.held:
                    self.held_passes[c] = self.held_passes.get(c, 0) + 1
        while self.pending:
            self._finish()
        if self.lane is not None:  # host-side gradient work stays on the lane, in order
            self.lane.submit(self._drain_ssd_writes)
        else:
            self._drain_ssd_writes()  # a later micro-batch may read these shards back
        self.fired = [0] * len(self.chunks)
        self.deferred_slots.clear()

    def drain(self) -> None:
        """Wait until every gradient sent to the host has landed in its shard."""
        if self.lane is not None:
            self.lane.drain()

    def end_step(self) -> None:
        """Before the optimizer step: finish this step's reduction and sum tied gradients across groups."""
        for c in list(self.held):  # the step came before the pass the engine expected to be its last
            self.held_passes[c] -= 1  # this reduction is that pass's
            self._reduce(c)
        self.end_backward()
        self.drain()
        for c in sorted(self.unscaled):  # the step came before the pass the engine expected to be its last
            self._scale(c)
            self.stats[c] = None
        if self.mode == "full":
            for c in sorted(self.buffers):
                buf = self.buffers[c]
                out = self._result_buffer(c, torch.float32, buf.device)
                chunk = self.chunks[c]
                chunk.collectives.reduce_scatter(out, buf, tag=f"chunk{c}").wait()
                if self.to_host[c]:
                    self._send_to_host(c, out, chunk.grad_factor, False)
                else:
                    self._accumulate(c, out, chunk.grad_factor, self._take_fresh(c))
                    self._keep_result(out)
                buf.zero_()
            self.drain()
        self.results.clear()
        for c in range(len(self.chunks)):  # shards without a gradient this step hold last step's values
            if not self.fresh[c]:
                continue
            self.stats[c] = None
            if self.on_ssd[c]:
                (grad,) = self.store.staging([self.chunks[c].key(State.GRAD)])
                self._write_ssd_grad(c, grad.zero_())
            else:
                self.chunks[c].grad.zero_()
                self.fresh[c] = False
        self._drain_ssd_writes()
        # MiCS / HSDP first: a tied chunk's shard is summed over its replicas before the tied groups sum it.
        replicas = [(c, self.chunks[c].collectives.replicate.group) for c in self.replicated]
        for c, group in replicas + list(self.tied_groups.items()):
            self.stats[c] = None
            if not self.on_ssd[c]:
                group_all_reduce(self.chunks[c].grad, group, device=self.chunks[c].full.device)
                continue
            key = self.chunks[c].key(State.GRAD)
            (grad,) = self.store.swap_in([key]).wait()
            group_all_reduce(grad, group, device=self.chunks[c].full.device)
            self._write_ssd_grad(c, grad)
            self._drain_ssd_writes()  # a tied chunk that is also replicated is read back next

    def norm_stats_parts(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """norm_stats of all of this rank's gradient shards, summed where they were taken: (the host's part, a
        CPU tensor; the device's part), None for a part with no shards. No value crosses between the two."""
        host = device = None
        fused = [c for c in range(len(self.chunks)) if self.fused[c]]
        for c in range(len(self.chunks)):
            if self.fused[c]:
                continue
            stats = self.shard_norm_stats(c)
            if stats.device.type == "cpu":
                host = stats.clone() if host is None else host.add_(stats)
            else:
                device = stats.clone() if device is None else device.add_(stats)
        if fused:
            part = fused_norm_stats([self.chunks[c].grad for c in fused], [self.norm_ranges[c] for c in fused])
            device = part if device is None else device.add_(part)
        return host, device

    def shard_norm_stats(self, c: int) -> torch.Tensor:
        """norm_stats of chunk ``c``'s accumulated gradient shard (SSD shards: taken when last written)."""
        if self.on_ssd[c]:
            return self.ssd_stats[c]
        if self.stats[c] is None:
            self.stats[c] = norm_stats(self.chunks[c].grad, self.norm_ranges[c])
        return self.stats[c]

    def new_step(self) -> None:
        """The step consumed (or discarded) the gradients: the next step's first results overwrite them."""
        self.fresh = [True] * len(self.chunks)
        self.scaled.clear()
        self.held_passes = {}
        self.ssd_stats.clear()
        self.stats = [None] * len(self.chunks)


def _scale_into(shard: torch.Tensor, value: torch.Tensor, scale: float, first: bool) -> None:
    """``shard = value * scale`` (``first``) or ``shard += value * scale``, in fp32, with no temporary: a 16-bit
    ``value`` is widened inside the kernel (the arithmetic and the result are those of ``value.float()``)."""
    if not first:
        shard.add_(value, alpha=scale)
    elif value.dtype == shard.dtype:
        torch.mul(value, scale, out=shard)
    else:
        shard.copy_(value).mul_(scale)


class SpareBuffers:
    """Flat buffers kept for reuse, each ``numel`` elements so that any fits any request, at most ``cap``.

    On the CPU a new buffer is a mapping of its own (host_memory.py) whose pages are faulted in and zeroed as
    they are first written, so each spare remembers how many of its leading elements have been used (resident
    from then on): a request takes the spare it fits in that is used the least beyond its size, or else the
    most used one, so that small requests do not leave a large one fresh pages."""

    def __init__(self, numel: int, cap: int):
        self.numel, self.cap = numel, cap
        self.free: list[torch.Tensor] = []
        self.used: dict[int, int] = {}  # id of a buffer taken from or kept here -> elements used so far

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``numel`` elements of a spare buffer (or of a new one) of that dtype and device."""
        fits = [t for t in self.free if t.dtype == dtype and t.device == device]
        if fits:
            covered = [t for t in fits if self.used[id(t)] >= numel]
            best = (min(covered, key=lambda t: self.used[id(t)]) if covered
                    else max(fits, key=lambda t: self.used[id(t)]))
            self.free = [t for t in self.free if t is not best]
            return best[:numel]
        buf = empty_mapped(self.numel, dtype, device)
        self.used[id(buf)] = 0
        return buf[:numel]

    def give(self, view: torch.Tensor) -> None:
        """``view`` (from ``take``) is no longer used: keep its buffer while there is room, else drop it."""
        base = view if view._base is None else view._base
        if len(self.free) < self.cap:
            self.used[id(base)] = max(self.used.get(id(base), 0), view.numel())
            self.free.append(base)
        else:
            self.used.pop(id(base), None)

    def forget(self, view: torch.Tensor) -> None:
        """``view`` (from ``take``) will not come back: its memory goes once nothing else refers to it."""
        self.used.pop(id(view if view._base is None else view._base), None)

    def clear(self) -> None:
        """Drop the spare buffers (their memory goes back once nothing views them)."""
        self.free, self.used = [], {}
