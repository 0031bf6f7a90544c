"""This machine's sustained fp32 matmul rate per rank, with every rank of a job computing at once."""
from __future__ import annotations

import multiprocessing as mp
import time

MATMUL_SIZE = 256  # fits a core's caches: near the core's peak, like the GPU datasheet figure it is set against


def _rank(barrier, results, index: int, warmup_s: float, seconds: float) -> None:
    import torch

    torch.set_num_threads(1)  # what a rank gets under torchrun (OMP_NUM_THREADS=1)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    out = torch.empty(MATMUL_SIZE, MATMUL_SIZE)
    barrier.wait()
    start = time.monotonic()
    while time.monotonic() < start + warmup_s:
        torch.mm(a, b, out=out)
    # every rank counts its matmuls over the same wall-clock window, so they share the cores throughout
    count, begin = 0, time.monotonic()
    end = begin + seconds
    while (now := time.monotonic()) < end:
        torch.mm(a, b, out=out)
        count += 1
    results[index] = 2.0 * MATMUL_SIZE**3 * count / (now - begin)


def flops_per_rank(ranks: int, seconds: float = 3.0, warmup_s: float = 1.0) -> tuple[float, list[float]]:
    """FLOP/s a rank gets when ``ranks`` single-threaded processes run matmuls over the same window (the
    machine's total over the window, divided by ``ranks``), and each process's own figure."""
    import torch  # noqa: F401  (imported once here; the forked processes inherit it)

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(ranks)
    results = ctx.Array("d", ranks)
    procs = [ctx.Process(target=_rank, args=(barrier, results, i, warmup_s, seconds)) for i in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"the matmul measurement failed in process(es) {failed}")
    per_rank = list(results)
    return sum(per_rank) / ranks, per_rank
