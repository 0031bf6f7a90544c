"""Slow ranks named before they cost hours (``--log-straggler``, Megatron's flag).

In a synchronous step every rank waits for the slowest, so step times cannot tell which rank is slow: they
are all the same. What differs is each rank's own compute speed (a GPU throttled by heat or power, a degraded
host, a noisy neighbour). So at every log interval each rank times the same small matmul probe on its device,
the ranks gather the times (one all-gather, on every rank at the same point of the loop), and the logging rank
prints the fastest, median and slowest. A rank slower than the median by ``--straggler-factor`` for
``--straggler-intervals`` log intervals in a row is named in one line, with its host; every further such run
of intervals names it again.
"""
from __future__ import annotations

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

    def check(self) -> list[str]:
        mine = torch.tensor([self.probe(self.device)], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in self.hosts]
        dist.all_gather(every, mine, group=self.group)
        times = [t.item() for t in every]
        median = statistics.median(times)
        fastest, slowest = min(range(len(times)), key=times.__getitem__), max(range(len(times)), key=times.__getitem__)
        lines = [f"straggler check: matmul probe {median * 1e3:.2f} ms median, fastest rank {fastest} "
                 f"{times[fastest] * 1e3:.2f} ms, slowest rank {slowest} {times[slowest] * 1e3:.2f} ms "
                 f"({times[slowest] / median:.2f}x the median)"]
        for rank, t in enumerate(times):
            self.streaks[rank] = self.streaks[rank] + 1 if t > self.cfg.factor * median else 0
            if self.streaks[rank] and self.streaks[rank] % self.cfg.intervals == 0:
                lines.append(f"straggler: rank {rank} ({self.hosts[rank]}) computes {t / median:.2f}x slower than "
                             f"the median rank for {self.streaks[rank]} log intervals in a row (matmul probe "
                             f"{t * 1e3:.2f} ms against {median * 1e3:.2f} ms); every rank waits for it in each "
                             f"collective: check its clocks, temperature and neighbours, or leave its host out")
        return lines
