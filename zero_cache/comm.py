"""Collectives over one process group, with optional per-collective time/bytes profiling.

Works without torch.distributed (a group of one) so single-process use needs no process group; with no
peer nothing is communicated and nothing is recorded. ``is_communication_time_profiling`` records every
collective on the group: its kind, bytes, the seconds from issue to completion and the seconds the
caller sat blocked in ``wait()``, all host clock (on CUDA, NCCL's ``wait()`` returns once the compute stream
is ordered after the collective, so there the times are host-side spans, not kernel times; counts and bytes
are exact everywhere). ``CommProfiler.end_step`` turns one step's records into a
``CommStepStats`` (per kind totals next to the ZeRO theory, see comm_theory.py); ``events`` doubles as an
ordered trace that tests use to check that prefetch gathers are issued ahead of compute.
``observe_collectives`` reports every collective issued over any group (the data-parallel one and
``group_all_reduce``'s), with its tensor and group, whether profiling is on or not.

Bytes of a collective: the size of the full buffer it produces or consumes on this rank (all-gather: the
gathered output; reduce-scatter: the unreduced input; all-reduce and broadcast: the tensor). A ring
algorithm sends and receives (N-1)/N of that per rank.

On gloo, all-gather and reduce-scatter of flat host tensors run as point-to-point exchanges
(``p2p_on_gloo``, on by default; gloo's point-to-point ops take host memory only). Gloo's own
``reduce_scatter_tensor`` clones the input and runs a full all-reduce on it (twice the bytes), and its
``all_gather_into_tensor`` gathers into a temporary and copies out. Sending each peer its piece straight
from and into the caller's tensors moves (N-1)/N of the buffer per rank with no temporaries (a
reduce-scatter over N > 2 ranks receives N - 2 pieces into one).
Measured with 2 ranks on this project's 2-core box: all-gather 2.7x and reduce-scatter 1.7x faster, at a
third and half of the CPU time.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def all_gather_flat(*args, **kwargs):
    """torch.distributed's flat-tensor all-gather, looked up when called (torch 2.13 names it
    ``all_gather_single``; older releases, such as the GPU images' 2.11, ``all_gather_into_tensor``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def reduce_scatter_flat(*args, **kwargs):
    """The flat-tensor reduce-scatter: ``reduce_scatter_single`` (2.13) or ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


# Collective observers (``observe_collectives``): called on the thread that asks for each collective.
_observers: list[Callable[[str, torch.Tensor, object, str], None]] = []


@contextmanager
def observe_collectives(fn: Callable[[str, torch.Tensor, object, str], None]):
    """Within the block, ``fn(kind, tensor, group, tag)`` is called for every collective this module issues over
    a process group, on any backend: ``Comm``'s (also gloo's point-to-point ones) and ``group_all_reduce``'s.

    ``kind`` is one of COLLECTIVES; ``tensor`` is the buffer the collective produces (all-gather), consumes
    (reduce-scatter) or reduces in place (all-reduce, broadcast; ``group_all_reduce``'s staged device copy when
    it stages a host tensor); ``group`` the process group; ``tag`` the caller's name for it ("" from
    ``group_all_reduce``). A group of one issues nothing and reports nothing. Calls come in the order the
    caller asks for the collectives, which on a GPU is the order NCCL runs them in (a collective waiting for a
    copy is issued at once from a side stream); on the emulated accelerator gloo's point-to-point gathers are
    started later by a copy stream's thread, which their tags keep apart from other kinds. Tests use it to see
    what an engine communicates, over which group, from which device and in which order; it needs no
    profiling and changes nothing that is communicated."""
    _observers.append(fn)
    try:
        yield fn
    finally:
        _observers.remove(fn)


def _observe(kind: str, tensor: torch.Tensor, group, tag: str = "") -> None:
    for fn in list(_observers):
        fn(kind, tensor, group, tag)


@dataclass
class CommEvent:
    op: str
    tag: str
    nbytes: int
    issued: float
    seconds: float = -1.0  # issue to completion, filled when waited
    blocked: float = 0.0  # time the waiter spent inside wait()


@dataclass(frozen=True)
class CollectiveTotals:
    """One kind of collective over one step (theory: count and bytes only)."""
    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0  # sum of spans from issue until a waiter saw completion (async ones overlap compute)
    wait_seconds: float = 0.0  # sum of the time callers sat blocked in wait(): the exposed part


@dataclass(frozen=True)
class CommStepStats:
    """Collectives of one optimizer step on this rank's data-parallel group, measured and in theory.

    Measured covers everything issued since the previous step (the first step also carries the start-up
    broadcast of the initial weights; checkpoint loads and exports land in the step that follows them)."""
    measured: dict[str, CollectiveTotals]  # every kind in COLLECTIVES
    theory: dict[str, CollectiveTotals]

    def bytes_vs_theory(self, kind: str) -> float | None:
        """Measured bytes over theory bytes (None when theory expects none of this kind)."""
        expected = self.theory[kind].nbytes
        return self.measured[kind].nbytes / expected if expected else None

    def fields(self) -> list[str]:
        """One text field per kind that happened or was expected."""
        out = []
        for kind in COLLECTIVES:
            m, t = self.measured[kind], self.theory[kind]
            if not (m.count or t.count):
                continue
            ratio = self.bytes_vs_theory(kind)
            vs = f"{ratio:.2f}x theory" if ratio is not None else "theory 0"
            out.append(f"{kind}: {m.count} calls, {m.nbytes / 2**20:.2f} MiB ({vs}), {m.seconds * 1e3:.1f} ms, "
                       f"{m.wait_seconds * 1e3:.1f} ms waited")
        return out

    def line(self) -> str:
        return "; ".join(self.fields()) or "no collectives"


class CommProfiler:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: list = []  # CommEvent, or any marker a caller appends (ordered trace)
        self._step: list[CommEvent] = []  # this step's collectives
        self.last_step: CommStepStats | None = None

    def issue(self, op: str, tag: str, nbytes: int) -> CommEvent | None:
        if not self.enabled:
            return None
        ev = CommEvent(op, tag, nbytes, time.perf_counter())
        self.events.append(ev)
        self._step.append(ev)
        return ev

    def end_step(self, theory: dict[str, CollectiveTotals]) -> CommStepStats:
        """Close the step: totals per kind of everything issued since the previous call (all waited by now)."""
        acc = {kind: [0, 0, 0.0, 0.0] for kind in COLLECTIVES}
        for ev in self._step:
            a = acc[ev.op]
            a[0] += 1
            a[1] += ev.nbytes
            a[2] += max(ev.seconds, 0.0)
            a[3] += ev.blocked
        self._step = []
        self.last_step = CommStepStats({k: CollectiveTotals(*a) for k, a in acc.items()},
                                       {k: theory.get(k, CollectiveTotals()) for k in COLLECTIVES})
        return self.last_step


class Handle:
    """Result of an async collective; ``wait()`` is idempotent and records the time."""

    def __init__(self, work, event: CommEvent | None):
        self._work, self._event = work, event

    def wait(self) -> None:
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            self._work = None
            if self._event is not None:
                done = time.perf_counter()
                self._event.seconds = done - self._event.issued
                self._event.blocked = done - start


class _Exchange:
    """The sends and receives of one point-to-point collective, and what completes it on ``wait()``."""

    def __init__(self, works: list, finish=None):
        self._works, self._finish = works, finish

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        if self._finish is not None:
            self._finish()


# Point-to-point tags of the gloo collectives: a receive matches the sends of its tag in issue order, and
# every rank issues its collectives in the same order (as any ZeRO-3 collective requires).
_TAG_ALL_GATHER, _TAG_REDUCE_SCATTER, _TAG_ALL_TO_ALL = 0x2A01, 0x2A02, 0x2A03


class _AfterLocal:
    """No peer: the "collective" is a local copy, done once the compute stream waited for ``after``."""

    def __init__(self, streams, after, local):
        self._streams, self._after, self._local = streams, after, local

    def wait(self) -> None:
        if self._local is not None:
            self._streams.wait(self._after)
            self._local()
            self._local = None


class Comm:
    def __init__(self, group, profiler: CommProfiler, p2p_on_gloo: bool = True, streams=None):
        self.streams = streams  # copy streams: collectives with ``after`` are ordered after a copy (streams.py)
        self.group = group
        self.profiler = profiler
        self.active = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        if self.size == 1:
            self.active = False
        self.p2p = self.active and p2p_on_gloo and dist.get_backend(group) == dist.Backend.GLOO
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(self.size)] if self.active else [0]

    def _exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], tag: int, finish=None):
        """Post every send and receive (keyed by group rank) at once; gloo completes them in its own thread."""
        works = [dist.irecv(t, src=self._global[r], group=self.group, tag=tag) for r, t in recvs.items()]
        works += [dist.isend(t, dst=self._global[r], group=self.group, tag=tag) for r, t in sends.items()]
        return _Exchange(works, finish)

    def _p2p_all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> _Exchange:
        pieces = out.chunk(self.size)
        mine = pieces[self.rank]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        peers = [r for r in range(self.size) if r != self.rank]
        return self._exchange({r: mine for r in peers}, {r: pieces[r] for r in peers}, _TAG_ALL_GATHER)

    def _p2p_reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> _Exchange:
        """The first peer's piece lands in ``out`` itself, so two ranks need no temporary at all."""
        pieces = full.chunk(self.size)
        peers = [r for r in range(self.size) if r != self.rank]
        extra = torch.empty((len(peers) - 1, out.numel()), dtype=out.dtype, device=out.device)
        recvs = {peers[0]: out.view(-1), **{r: extra[i] for i, r in enumerate(peers[1:])}}

        def finish():
            out.add_(pieces[self.rank].view_as(out))
            for t in extra:
                out.add_(t.view_as(out))
        return self._exchange({r: pieces[r] for r in peers}, recvs, _TAG_REDUCE_SCATTER, finish)

    def _run(self, kind: str, tag: str, tensor: torch.Tensor, collective, local, async_op: bool,
             after=None) -> Handle:
        """Profile, report (``observe_collectives``) and run ``collective`` (async) over the group, or ``local``
        when there is no peer. ``tensor``: the buffer the collective's bytes are counted on (module docstring).

        ``after`` (a streams.Event): the collective reads memory a copy is writing; it is issued ordered after
        that copy, not after the compute stream (``Streams.issue_after``)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.active:
            if after is None:
                local()
                return Handle(None, None)
            h = _AfterLocal(self.streams, after, local)
        else:
            def start():
                ev = self.profiler.issue(kind, tag, nbytes)
                return Handle(collective(), ev)
            _observe(kind, tensor, self.group, tag)
            h = start() if after is None else self.streams.issue_after(after, start, may_defer=self.p2p)
        if not async_op:
            h.wait()
        return h

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, tag: str = "", async_op: bool = False,
                   after=None) -> Handle:
        def local():
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
        collective = (partial(self._p2p_all_gather, out, shard) if self.p2p and out.device.type == "cpu"
                      else partial(all_gather_flat, out, shard, group=self.group, async_op=True))
        return self._run("all_gather", tag, out, collective, local, async_op, after)

    def all_gather_packed(self, packed: torch.Tensor, mine: torch.Tensor, finish: Callable[[], None], tag: str = "",
                          after=None) -> Handle:
        """Async all-gather of this rank's byte buffer ``mine`` into ``packed`` (``size`` times its bytes), then
        ``finish()`` when waited (a quantized gather dequantizes there). Profiled as an all-gather of the bytes."""
        collective = (partial(self._p2p_all_gather, packed, mine) if self.p2p and packed.device.type == "cpu"
                      else partial(all_gather_flat, packed, mine, group=self.group, async_op=True))
        return self._run("all_gather", tag, packed, lambda: _Exchange([collective()], finish),
                         lambda: (packed.copy_(mine), finish()), True, after)

    def all_to_all(self, out: torch.Tensor, pieces: torch.Tensor, tag: str = "") -> None:
        """``out[r]`` = rank r's ``pieces[self.rank]``, for 2-D ``out`` and ``pieces`` of ``size`` rows (blocking).
        Profiled as a reduce-scatter: it is one, done in pieces (qgZ)."""
        def local():
            out.copy_(pieces)
        if self.p2p and out.device.type == "cpu":
            peers = [r for r in range(self.size) if r != self.rank]

            def collective():
                out[self.rank].copy_(pieces[self.rank])
                return self._exchange({r: pieces[r] for r in peers}, {r: out[r] for r in peers}, _TAG_ALL_TO_ALL)
        else:
            def collective():
                return dist.all_to_all_single(out, pieces, group=self.group, async_op=True)
        self._run("reduce_scatter", tag, pieces, collective, local, async_op=False)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str = "", async_op: bool = False) -> Handle:
        def local():
            out.copy_(full)
        collective = (partial(self._p2p_reduce_scatter, out, full) if self.p2p and full.device.type == "cpu"
                      else partial(reduce_scatter_flat, out, full, group=self.group, async_op=True))
        return self._run("reduce_scatter", tag, full, collective, local, async_op)

    def all_reduce(self, t: torch.Tensor, op=None, tag: str = "") -> None:
        self._run("all_reduce", tag, t,
                  lambda: dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group, async_op=True),
                  lambda: None, async_op=False)

    def broadcast_from_first(self, t: torch.Tensor, tag: str = "") -> None:
        src = dist.get_global_rank(self.group, 0) if self.active and self.group is not None else 0
        self._run("broadcast", tag, t,
                  lambda: dist.broadcast(t, src=src, group=self.group, async_op=True), lambda: None, async_op=False)


def group_all_reduce(t: torch.Tensor, group, op=None, device: torch.device | None = None) -> None:
    """All-reduce over an optional extra group (model-parallel or tied-parameter group).

    A host tensor goes through ``device`` when the group's backend cannot reduce host memory (NCCL)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    staged = t
    if t.device.type == "cpu" and device is not None and device.type != "cpu" and \
            dist.get_backend(group) == dist.Backend.NCCL:
        staged = t.to(device)
    _observe("all_reduce", staged, group)
    dist.all_reduce(staged, op=op or dist.ReduceOp.SUM, group=group)
    if staged is not t:
        t.copy_(staged)
