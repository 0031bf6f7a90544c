"""Collectives over one process group, with optional per-collective time/bytes profiling.

Works without torch.distributed (a group of one) so single-process use needs no process group.
``is_communication_time_profiling`` records every collective (issue order, bytes, seconds from issue to
completion) and the engine prints a per-step summary; ``events`` doubles as an ordered trace that tests
use to check that prefetch gathers are issued ahead of compute.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommEvent:
    op: str
    tag: str
    nbytes: int
    issued: float
    seconds: float = -1.0  # filled when waited


class CommProfiler:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: list = []  # CommEvent, or any marker a caller appends (ordered trace)

    def issue(self, op: str, tag: str, nbytes: int) -> CommEvent | None:
        if not self.enabled:
            return None
        ev = CommEvent(op, tag, nbytes, time.perf_counter())
        self.events.append(ev)
        return ev

    def summary_and_reset(self) -> str:
        per_op: dict[str, list[float]] = {}
        for ev in self.events:
            if isinstance(ev, CommEvent):
                acc = per_op.setdefault(ev.op, [0, 0, 0.0])
                acc[0] += 1
                acc[1] += ev.nbytes
                acc[2] += max(ev.seconds, 0.0)
        self.events = []
        return "; ".join(f"{op}: {n} calls, {b / 2**20:.1f}MiB, {s * 1e3:.1f}ms" for op, (n, b, s) in per_op.items())


class Handle:
    """Result of an async collective; ``wait()`` is idempotent and records the time."""

    def __init__(self, work, event: CommEvent | None):
        self._work, self._event = work, event

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._event is not None:
                self._event.seconds = time.perf_counter() - self._event.issued


class Comm:
    def __init__(self, group, profiler: CommProfiler):
        self.group = group
        self.profiler = profiler
        self.active = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        if self.size == 1:
            self.active = False

    def _run(self, kind: str, tag: str, nbytes: int, collective, local, async_op: bool) -> Handle:
        """Profile, then run ``collective`` (async) over the group, or ``local`` when there is no peer."""
        ev = self.profiler.issue(kind, tag, nbytes)
        work = collective() if self.active else local()
        h = Handle(work, ev)
        if not async_op:
            h.wait()
        return h

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, tag: str = "", async_op: bool = False) -> Handle:
        def local():
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
        return self._run("all_gather", tag, out.numel() * out.element_size(),
                         lambda: dist.all_gather_single(out, shard, group=self.group, async_op=True), local, async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str = "", async_op: bool = False) -> Handle:
        def local():
            out.copy_(full)
        return self._run("reduce_scatter", tag, full.numel() * full.element_size(),
                         lambda: dist.reduce_scatter_single(out, full, group=self.group, async_op=True), local, async_op)

    def all_reduce(self, t: torch.Tensor, op=None, tag: str = "") -> None:
        if self.active:
            ev = self.profiler.issue("all_reduce", tag, t.numel() * t.element_size())
            Handle(dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group, async_op=True), ev).wait()

    def broadcast_from_first(self, t: torch.Tensor) -> None:
        if self.active:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(t, src=src, group=self.group)


def group_all_reduce(t: torch.Tensor, group, op=None, device: torch.device | None = None) -> None:
    """All-reduce over an optional extra group (model-parallel or tied-parameter group).

    A host tensor goes through ``device`` when the group's backend cannot reduce host memory (NCCL)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    staged = t
    if t.device.type == "cpu" and device is not None and device.type != "cpu" and \
            dist.get_backend(group) == dist.Backend.NCCL:
        staged = t.to(device)
    dist.all_reduce(staged, op=op or dist.ReduceOp.SUM, group=group)
    if staged is not t:
        t.copy_(staged)
