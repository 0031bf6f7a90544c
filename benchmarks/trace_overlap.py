"""The share of host <-> device copy time that a torch.profiler trace shows under the compute stream's kernels.

Reading a trace (Chrome format, as ``prof.export_chrome_trace`` writes it): the host-to-device and
device-to-host memcpy events, and the kernels. The compute stream is the stream whose kernels take the most
time (the model's GEMMs); the hidden share is the copy time that lies inside the union of that stream's kernel
intervals over all copy time. A copy issued on the compute stream itself waits for its kernels and they for it,
so it counts as not hidden (its time is also shown alone); copy-stream kernels (dtype conversions) are not
compute. Used by the peer workers' profiled steps and by ``python -m benchmarks.profile_overlap``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

COPY_KINDS = ("HtoD", "DtoH")


@dataclass(frozen=True)
class OverlapReport:
    copies: int
    kernels: int  # kernels on the compute stream
    copy_seconds: float
    hidden_seconds: float  # copy time during which a compute-stream kernel ran
    copy_streams: tuple[int, ...]
    compute_streams: tuple[int, ...]  # the busiest kernel stream (empty: no kernels)
    same_stream_seconds: float = 0.0  # copy time issued on the compute stream itself (serialised with it)

    @property
    def hidden(self) -> float:
        return self.hidden_seconds / self.copy_seconds if self.copy_seconds > 0 else 0.0

    @property
    def concurrent(self) -> bool:
        """Some copy time ran beside compute kernels."""
        return bool(self.copies) and bool(self.kernels) and self.hidden > 0

    def line(self) -> str:
        same = f", {self.same_stream_seconds * 1e3:.1f} ms on the compute stream itself" \
            if self.same_stream_seconds else ""
        return (f"{self.copies} host<->device copies on streams {list(self.copy_streams)}, {self.kernels} kernels on "
                f"compute stream {list(self.compute_streams)}: copy time {self.copy_seconds * 1e3:.1f} ms, "
                f"{self.hidden_seconds * 1e3:.1f} ms of it under compute ({100 * self.hidden:.0f}% hidden){same}")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if x < b and y > a)


def overlap_report(events: list[dict]) -> OverlapReport:
    """Copies against the compute stream's kernels in a Chrome trace's ``traceEvents`` (times in microseconds)."""
    copies, kernels = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), stream)
        if e.get("cat") == "gpu_memcpy" and any(k in e.get("name", "") for k in COPY_KINDS):
            copies.append(span)
        elif e.get("cat") == "kernel":
            kernels.append(span)
    busy: dict = {}
    for a, b, st in kernels:
        busy[st] = busy.get(st, 0.0) + (b - a)
    compute = max(busy, key=busy.get) if busy else None  # where the model's GEMMs run
    union = _union([(a, b) for a, b, st in kernels if st == compute])
    total = sum(b - a for a, b, _ in copies)
    hidden = sum(_covered(a, b, union) for a, b, st in copies if st != compute)
    same = sum(b - a for a, b, st in copies if st == compute)
    return OverlapReport(len(copies), sum(1 for *_, st in kernels if st == compute), total / 1e6, hidden / 1e6,
                         tuple(sorted({st for *_, st in copies}, key=str)), () if compute is None else (compute,),
                         same / 1e6)


def report_from_trace(path: str) -> OverlapReport:
    with open(path, encoding="utf-8") as f:
        return overlap_report(json.load(f)["traceEvents"])
