"""Slow ranks named before they cost hours (``--log-straggler``, Megatron's flag).

In a synchronous step every rank waits for the slowest, so step times cannot tell which rank is slow: they
are all the same. What differs is each rank's own compute speed (a GPU throttled by heat or power, a degraded
host, a noisy neighbour). So at every log interval each rank times the same small matmul probe on its device,
the ranks gather the times (one all-gather, on every rank at the same point of the loop), and the logging rank
prints the fastest, median and slowest. A rank slower than the median by ``--straggler-factor`` for
``--straggler-intervals`` log intervals in a row is named in one line, with its host; every further such run
of intervals names it again.

With them go each rank's mean step time since the last check and, where the engine profiles its collectives
(``is_communication_time_profiling``), the time it sat blocked in them in the last step: one line listing every
rank (the extremes only past 32 ranks). The rank that waits least is the one the others wait for.
"""
from __future__ import annotations

import math
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StragglerConfig:
    factor: float = 1.25  # slower than the median by this factor counts as slow
    intervals: int = 3  # ... for this many log intervals in a row: named

    def __post_init__(self):
        if self.factor <= 1.0 or self.intervals < 1:
            raise ValueError(f"--straggler-factor must be > 1 and --straggler-intervals >= 1 (got {self.factor:g}, "
                             f"{self.intervals})")


def probe_seconds(device: torch.device, repeats: int = 3) -> float:
    """The best of ``repeats`` timings of a fixed matmul workload on ``device`` (about 2 ms on an H100, 20-30 ms
    on a CPU core: longer than the periods in which a throttled CPU runs at full speed; the best of several
    ignores a one-off interruption that is not the device's speed)."""
    size, count = (4096, 8) if device.type == "cuda" else (256, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(count):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


class StragglerDetector:
    """``check()`` at every log interval on every rank; it returns the lines to print (the same on every rank)."""

    def __init__(self, cfg: StragglerConfig, device: torch.device, group: dist.ProcessGroup | None = None,
                 probe=probe_seconds):
        self.cfg, self.device, self.group, self.probe = cfg, device, group, probe
        self.hosts: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(self.hosts, socket.gethostname(), group=group)
        self.streaks = [0] * len(self.hosts)

    def check(self, step_seconds: float | None = None, waited_seconds: float | None = None) -> list[str]:
        """Probe, gather, judge; ``step_seconds``: this rank's mean step time since the last check,
        ``waited_seconds``: its time blocked in collectives in the last step (None: not measured)."""
        mine = torch.tensor([self.probe(self.device), _or_nan(step_seconds), _or_nan(waited_seconds)],
                            dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in self.hosts]
        dist.all_gather(every, mine, group=self.group)
        times = [t[0].item() for t in every]
        median = statistics.median(times)
        fastest, slowest = min(range(len(times)), key=times.__getitem__), max(range(len(times)), key=times.__getitem__)
        lines = [f"straggler check: matmul probe {median * 1e3:.2f} ms median, fastest rank {fastest} "
                 f"{times[fastest] * 1e3:.2f} ms, slowest rank {slowest} {times[slowest] * 1e3:.2f} ms "
                 f"({times[slowest] / median:.2f}x the median)"]
        if step_seconds is not None:
            lines.append(_per_rank_line([t.tolist() for t in every]))
        for rank, t in enumerate(times):
            self.streaks[rank] = self.streaks[rank] + 1 if t > self.cfg.factor * median else 0
            if self.streaks[rank] and self.streaks[rank] % self.cfg.intervals == 0:
                lines.append(f"straggler: rank {rank} ({self.hosts[rank]}) computes {t / median:.2f}x slower than "
                             f"the median rank for {self.streaks[rank]} log intervals in a row (matmul probe "
                             f"{t * 1e3:.2f} ms against {median * 1e3:.2f} ms); every rank waits for it in each "
                             f"collective: check its clocks, temperature and neighbours, or leave its host out")
        return lines


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _per_rank_line(rows: list[list[float]], most: int = 32) -> str:
    """'rank: step' or 'rank: step/blocked' (seconds) for every rank; past ``most`` ranks, only those with the
    shortest and longest step and the least and most time blocked."""
    def field(rank: int) -> str:
        _, step, waited = rows[rank]
        return f"{rank}: {step:.3f}" + ("" if math.isnan(waited) else f"/{waited:.3f}")
    ranks = list(range(len(rows)))
    if len(rows) > most:
        by_step = sorted(ranks, key=lambda r: rows[r][1])
        by_wait = sorted(ranks, key=lambda r: rows[r][2])
        ranks = sorted({by_step[0], by_step[-1], by_wait[0], by_wait[-1]})
    waited = not any(math.isnan(row[2]) for row in rows)
    what = "step s / blocked in collectives s" if waited else "step s"
    return f"straggler check: per rank ({what}): {', '.join(field(r) for r in ranks)}"
