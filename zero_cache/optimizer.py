"""Adam/AdamW over this rank's shards, one sub-group at a time, with torch's fused (vectorised) kernel.

Sub-groups are consecutive chunks of one parameter group holding at most ``sub_group_size`` shard
elements; their tensors live in one tier, so each sub-group is a single ``torch._fused_adamw_`` call
(the CPU kernel behind ``torch.optim.AdamW(fused=True)``). Unscaling and clipping are folded into the
kernel's ``grad_scale``. With ``pipeline_optimizer`` the write-back of sub-group i (fp32 master ->
compute-dtype parameter shard, possibly host -> device) runs on a worker thread while sub-group i+1
is updated; a write-back to the device is an asynchronous copy on the host-to-device stream (streams.py)
instead, overlapping the next sub-groups' updates.

Heterogeneous pipeline: with an accelerator (or the emulated one) the sub-groups whose states live on the
device (``prefetch_cache_sub_group_rate``) are updated by the device's fused Adam on the calling thread
while the host lane (host_lane.py) updates the host sub-groups and streams the SSD ones through the
pipeline below, concurrently; the planner picks the rate so both finish together.

Sub-groups whose states live on the SSD tier are swapped in, updated and swapped out (a gradient shard
on SSD is read with them and dropped). With
``pipeline_optimizer`` this is a three-stage pipeline on the store's I/O threads: while sub-group i is
updated, i+1 is being read (read-ahead) and earlier ones written back; at most three sub-groups' staging
buffers exist at once, unless the placement gave the staging pool spare host budget: then the first
sub-groups are read ahead while the backward runs, as many as the pool holds. Without the pipeline each
sub-group is read, updated and written in turn. The step does not wait for its write-backs: they finish
while the next forward runs, behind its reads (the store keeps each shard's reads after its write).
``last_swap`` reports the step's optimizer I/O time (from its first read, which may start in the
backward, to the step's end), the time the step was blocked on it, and their difference (the I/O hidden by
compute).

The update strategies (update/) drive these walks: ``step`` (the waiting step, also with the sub-groups an
accepted speculation already updated), ``step_delayed`` (the lock-free update: gradients from ``grad_spare``,
parameters into ``pending``), and ``begin``/``walk``/``end`` for the overlapped step, whose walk reports its
progress (``WalkProgress``) chunk by chunk. ``can_overlap``: there is something to hide (SSD I/O, or host
updates beside an accelerator's compute).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import torch

from .chunk import FlatChunk
from .host_lane import HostLane
from .states import State
from .store import DEVICE, ShardStore
from .streams import DONE, HostStreams, Streams


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


class WalkProgress(Protocol):
    """How a walk run in the background (the overlapped update) reports each sub-group it finishes."""

    def landed(self, chunk: int, event) -> None:
        """Chunk ``chunk``'s write-back copy to the device is queued; ``event`` marks its end."""

    def updated(self, chunks: list[int]) -> None:
        """These chunks' parameter shards are final (their SSD writes queued)."""


class ShardedAdam:
    def __init__(self, chunks: list[FlatChunk], sub_groups: list[list[int]], groups: list[GroupHParams], *,
                 lr: float, betas: tuple[float, float], eps: float, decoupled: bool, pipeline: bool,
                 store: ShardStore, streams: Streams | None = None, lane: HostLane | None = None):
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
        self.grads_on_ssd = any(c.on_ssd(State.GRAD) for c in chunks)
        self.has_ssd = any(c.swapped for c in chunks)  # the step reports its SSD traffic
        self.streams = streams or HostStreams()
        self.lane = lane  # with one, device and host sub-groups update concurrently
        self.on_device = [not self.swapped[k] and all(chunks[i].opt_tier == DEVICE for i in sg)
                          for k, sg in enumerate(sub_groups)]
        # Chunks whose write-back is a host-to-device copy: the master is in host memory (or read from SSD),
        # the compute-dtype parameter shard on the device.
        self.crossing = {c.index: self.streams.separate and c.opt_tier != DEVICE and not c.master_is_param()
                         and (c.plan.resident or store.tier_of(c.key(State.PARAM)) == DEVICE) for c in chunks}
        self._write_events: list = []
        self._reading: dict[int, object] = {}  # chunk -> source_free of a write-back copy reading its master
        self._after_compute: tuple = ()
        # Pipelined write-backs, for the whole run (both walks share it; its thread starts at the first one).
        self._write_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_cache_wb") if pipeline else None

    def _swap_keys(self, k: int) -> list[tuple[FlatChunk, State]]:
        return [(self.chunks[i], state) for i in self.sub_groups[k] for state in self.chunks[i].opt_swapped()]

    def _swap_in(self, k: int, optional: bool = False):
        """Start reading sub-group ``k``: (pairs, handle), or None when ``optional`` and the pool is full.

        Parameter shards a gather holds unchanged are left out (the backward's gathers release them as
        clean copies before the step, which then takes them without I/O: ``_walk``)."""
        pairs = [(c, n) for c, n in self._swap_keys(k)
                 if n is not State.PARAM or not self.store.held_unchanged(c.key(n))]
        handle = self.store.swap_in([c.key(n) for c, n in pairs], optional=optional)
        return None if handle is None else (pairs, handle)

    def start_read_ahead(self, during_backward: bool = False) -> None:
        """Start reading SSD sub-groups in step order, as many as the staging pool holds (always the first).

        Called when a backward starts (the placement gave spare host budget to the pool) and again before
        the step, while the grad norm is computed. Only with ``pipeline_optimizer``; not during a backward
        that writes gradient shards to SSD: their staging buffers come from the same pool."""
        todo = [k for k, s in enumerate(self.swapped) if s and k not in self._early]
        if not self.pipeline or not todo or (during_backward and self.grads_on_ssd):
            return
        unbounded = self.store.unbounded_staging()  # then the first sub-group only
        if unbounded and self._early:
            return
        if not self._early:
            self.store.io_totals_and_reset()
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

    def can_overlap(self) -> bool:
        """Whether ``step(background=True)`` is possible and worth it: pipelined, and some sub-groups on SSD
        (their I/O is what the next forward hides) or updated on the host while a separate device computes.
        Without an accelerator host updates would only take cores from the forward."""
        host_beside_device = self.streams.separate and not all(self.on_device)
        return self.pipeline and (any(self.swapped) or host_beside_device)

    def device_sub_groups(self) -> list[int]:
        """Sub-groups the calling thread updates with the device's kernel while the host lane walks the others
        (none without a lane)."""
        return [k for k in range(len(self.sub_groups)) if self.on_device[k]] if self.lane is not None else []

    def begin(self) -> dict:
        """Start a step: its I/O is counted from here (or from the first read ahead of it), its write-backs wait
        for the compute queued so far (the backward may still read resident chunks); returns the reads started
        ahead of it, for ``walk``."""
        if self.has_ssd and not self._early:
            self.store.io_totals_and_reset()
        self._after_compute = (self.streams.compute_event(),)
        reads, self._early = self._early, {}
        return reads

    def end(self, blocked: float) -> None:
        """The step's walks are done: ``last_swap`` from its I/O totals and the seconds it was ``blocked``."""
        io, r, w = self.store.io_totals_and_reset()
        self.last_swap = SwapStats(io, blocked, r, w)

    def step(self, grad_scale: float, skip: frozenset[int] = frozenset()) -> None:
        """One update of every shard; gradients are divided by ``grad_scale`` inside the kernel. ``skip``:
        sub-groups already updated (an accepted speculation); only their write-back is left.

        With a host lane, the device sub-groups are updated by the calling thread (the device's fused Adam)
        while the lane updates the host sub-groups and streams the SSD ones through the pipeline."""
        reads = self.begin()
        todo = [k for k in range(len(self.sub_groups)) if k not in skip]
        device = [k for k in self.device_sub_groups() if k not in skip]
        host = [k for k in todo if k not in device]
        if device and host:
            lane = self.lane.submit(self.walk, host, grad_scale, reads)
            try:
                self.walk(device, grad_scale, {})
            finally:
                waited = lane.result()
        else:
            waited = self.walk(todo, grad_scale, reads)
        for k in sorted(skip):
            self._write_back([c for c in (self.chunks[i] for i in self.sub_groups[k]) if not c.master_is_param()])
        if self.has_ssd:
            self.end(waited)

    def step_delayed(self, grad_scale: float) -> None:
        """The lock-free update's step (run on its own thread): reads ``grad_spare`` (not zeroed: the next step's
        first reductions overwrite it, see grad_reducer.py) and leaves the updated parameters in ``pending``,
        not in the parameter shards the next step reads."""
        reads = self.begin()
        waited = self.walk(list(range(len(self.sub_groups))), grad_scale, reads, grads=State.GRAD_SPARE,
                           into=State.PENDING)
        if self.has_ssd:
            self.end(waited)

    def walk(self, ks: list[int], grad_scale: float, reads: dict, progress: WalkProgress | None = None,
             grads: State = State.GRAD, into: State = State.PARAM) -> float:
        """Update sub-groups ``ks`` in order (SSD ones pipelined); returns the seconds blocked on SSD.

        SSD write-backs are left in flight: the store orders each page file's I/O and takes staging buffers
        back from writes as later reads need them, so the step's last writes drain under the next forward.
        With an unbounded staging pool the walk bounds them itself (one behind the update, or none).
        ``progress``: a walk in the background; each sub-group's chunks are announced once their parameter
        shards are final (a copy to the device: queued, its event handed over per chunk), and host write-backs
        run inline. ``grads``: the gradient state read; ``into``: where the updated parameters go (PARAM:
        written back; PENDING: copied there for a later publish)."""
        futures, writes = [], []
        waited = 0.0
        in_step_bound = self.store.unbounded_staging()
        try:
            for idx, k in enumerate(ks):
                sg = self.sub_groups[k]
                if self.swapped[k]:
                    nxt = ks[idx + 1] if idx + 1 < len(ks) else None
                    for j in (k, nxt) if self.pipeline else (k,):  # read-ahead of the next sub-group
                        if j is not None and self.swapped[j] and j not in reads:
                            reads[j] = self._swap_in(j)
                    pairs, handle = reads.pop(k)
                    have = {c.key(n) for c, n in pairs}
                    missing = [(c, n) for c, n in self._swap_keys(k) if c.key(n) not in have]
                    parts = [(pairs, handle)]
                    if missing:  # left out of the read-ahead: a gather held them (now, most likely cached)
                        keys = [c.key(n) for c, n in missing]
                        parts.append((missing, self.store.swap_in(keys, params=True)))
                    for got, h in parts:
                        for (c, state), t in zip(got, h.wait()):
                            c.attach(state, t)
                        waited += h.waited
                    pairs = pairs + missing
                cs = [self.chunks[i] for i in sg]
                self.update_chunks(cs, grad_scale, grads)
                todo = [c for c in cs if not c.master_is_param()]
                if into is State.PENDING:
                    for c in todo:
                        c.pending.copy_(c.master)
                    todo = []
                on_ssd = [c for c in todo if c.on_ssd(State.PARAM)]  # bf16/fp16 parameter shards on SSD
                if on_ssd:
                    todo = [c for c in todo if not c.on_ssd(State.PARAM)]
                    for c in on_ssd:
                        self.store.put(c.key(State.PARAM), c.master)
                if self.swapped[k]:
                    self._write_back(todo, progress)
                    for c in todo:  # the copy read the master's staging buffer before it goes back
                        self.streams.synchronize(self._reading.pop(c.index, DONE))
                    # Gradient shards on SSD are consumed, not written back (the next step overwrites them).
                    dirty = [(c, state) for c, state in pairs if state is not State.GRAD]
                    tensors = [c.tensor(state) for c, state in dirty]
                    self.store.release([c.grad for c, state in pairs if state is State.GRAD])
                    for c, state in pairs:
                        c.attach(state, None)
                    # The next forward gathers the updated parameter shards: they stay as clean copies.
                    keys = [c.key(state) for c, state in dirty]
                    writes.append(self.store.swap_out(keys, tensors, keep=[k for k, (_, state) in zip(keys, dirty)
                                                                           if state is State.PARAM]))
                    while in_step_bound and len(writes) > (1 if self.pipeline else 0):  # i-1's overlaps i
                        w = writes.pop(0)
                        w.wait()
                        waited += w.waited
                elif todo:
                    if self._write_pool is None or progress is not None or any(self.crossing[c.index] for c in todo):
                        self._write_back(todo, progress)  # copies to the device are asynchronous already
                    else:
                        futures.append(self._write_pool.submit(self._write_back, todo))
                if progress is not None:
                    progress.updated(sg)
            for f in futures:
                f.result()
        except BaseException:
            for w in writes:  # the step fails with the first error: no write of it is left in flight
                _quiet_wait(w)
            raise
        finally:
            wait(futures)  # never return while a write-back still reads a master
            for _, h in reads.values():  # after an error: no I/O may still target a staging buffer
                if _quiet_wait(h):
                    self.store.release(h.wait())
        return waited

    def _write_back(self, chunks: list[FlatChunk], progress: WalkProgress | None = None) -> None:
        """fp32 master -> compute-dtype parameter shard; a shard on the device is reached by an asynchronous
        copy, whose event ``wait_write_back`` (the ``progress`` of a walk in the background) hands to the
        compute stream."""
        for c in chunks:
            if self.crossing[c.index]:
                copy = self.streams.h2d(c.param_shard, c.master, after=self._after_compute)
                if progress is not None:
                    progress.landed(c.index, copy.done)
                else:
                    self._write_events.append(copy.done)
                self._reading[c.index] = copy.source_free
            else:
                c.param_shard.copy_(c.master)

    def wait_write_back(self) -> None:
        """The compute stream waits for every write-back copy (before any parameter is read again)."""
        events, self._write_events = self._write_events, []
        for e in events:
            self.streams.wait(e)

    def update_chunks(self, cs: list[FlatChunk], grad_scale: float, grads: State = State.GRAD) -> None:
        """One fused Adam call over chunks ``cs`` (one sub-group: one tier, one parameter group)."""
        for c in cs:  # a write-back copy reading this master directly (pinned) must have read it
            if c.index in self._reading:
                self.streams.synchronize(self._reading.pop(c.index))
        masters = [c.master for c in cs]
        steps = [c.step for c in cs]
        torch._foreach_add_(steps, 1.0)
        scale = None
        if grad_scale != 1.0:  # a fill kernel on an accelerator: no host-to-device copy of a Python scalar
            scale = torch.full((), grad_scale, dtype=torch.float32, device=masters[0].device)
        self.kernel(masters, [c.tensor(grads) for c in cs], [c.exp_avg for c in cs], [c.exp_avg_sq for c in cs], [],
                    steps, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                    weight_decay=self.groups[cs[0].plan.group].weight_decay, eps=self.eps,
                    amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)

    def close(self) -> None:
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=True)
            self._write_pool = None

    def state_dict(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps}


def _quiet_wait(handle) -> bool:
    """Wait for ``handle``; False if it failed (the step is already failing with the first error)."""
    try:
        handle.wait()
    except Exception:
        return False
    return True
