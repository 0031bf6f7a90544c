"""This machine as a cluster profile (profiles.py) for the step-time model: what one rank of a job here computes,
moves through memory and sends to another rank, measured.

Each rank of a CPU job gets ``threads`` intra-op threads (the launcher gives each cores / ranks); the
measurements run with that many threads in this process, while the other ranks' share of the machine is left
idle, so they are what one rank reaches when its neighbours compute too only where the cores are not shared
(the trainer's ranks each own their cores). Figures:

- GEMMs: fp32 matmuls of the shapes a small GPT's layers make, the fastest of 7 each: time = F / rate + call,
  the rate from the three largest, the per-call cost from the smallest; the rate stated as the peak (share 1.0).
- Attention: torch's SDPA (causal) at a layer's shape, as a share of that rate counting half the full product.
- Memory: a large tensor's copy, bytes read and written over the time (the copies between tiers); elementwise
  kernels (LayerNorm, GELU, forward and backward) as a share of it.
- Collectives take the cores the compute uses: nothing overlaps (``overlaps_comm`` False).
- The link: gloo all-reduce between two processes on this machine at two sizes: rate and latency.
- Host Adam: torch's fused AdamW (step_time.measure_host_adam).
- The disk: a 256 MiB file written, synced and read back past the page cache.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ptm_planner.profiles import MEASURED_HERE_ERROR, Accelerator, ClusterProfile, Link
from ptm_planner.step_time import Speeds, measure_host_adam

LINK_TIMEOUT_S = 120
GEMM_SHAPES = ((256, 256, 256), (1024, 256, 256), (1024, 256, 1024), (1024, 1024, 256), (2048, 512, 512),
               (2048, 512, 2048), (4096, 1024, 1024))


def _timed(fn, repeats: int = 5, best: bool = False) -> float:
    """Median seconds of ``repeats`` calls after one untimed (the fastest with ``best``: the least disturbed by
    anything else running)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def gemm_fit() -> tuple[float, float]:
    """(FLOP/s, seconds per call) of fp32 matmuls: the rate is the median of the three largest shapes', the
    per-call cost what the smallest shape takes beyond its FLOPs at that rate."""
    fs, ts = [], []
    for m, k, n in GEMM_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        fs.append(2.0 * m * k * n)
        ts.append(_timed(lambda a=a, b=b: a @ b, repeats=7, best=True))
    rate = statistics.median(f / t for f, t in list(zip(fs, ts))[-3:])
    return rate, max(0.0, ts[0] - fs[0] / rate)


def attention_rate(batch: int = 4, heads: int = 4, seq: int = 256, head_dim: int = 64) -> float:
    """FLOP/s of causal SDPA, counting half of the full product's 4 b a s^2 d FLOPs."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim) for _ in range(3))
    t = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    return 2.0 * batch * heads * seq * seq * head_dim / t


def memory_gbps(elements: int = 1 << 25) -> float:
    x, y = torch.empty(elements), torch.empty(elements)
    x.normal_()
    t = _timed(lambda: y.copy_(x))
    return 2 * 4 * elements / t / 1e9


def disk_gbps(folder: str, nbytes: int = 256 << 20) -> float:
    """GB/s of writing ``nbytes`` to a file under ``folder`` (synced) and reading it back past the page cache,
    the two together, as the SSD tier's optimizer step does."""
    os.makedirs(folder, exist_ok=True)
    block = os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(dir=folder, prefix="ptm-measure-")
    try:
        t0 = time.perf_counter()
        for _ in range(nbytes >> 20):
            os.write(fd, block)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        while os.read(fd, 1 << 20):
            pass
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return 2 * nbytes / seconds / 1e9


def elementwise_gbps(tokens: int = 512, hidden: int = 512, ffn: int = 2048) -> float:
    """GB/s a layer's elementwise kernels reach, forward and backward: LayerNorm over [tokens, hidden] and GELU
    over [tokens, ffn] (each reads and writes its tensor forward, and reads two and writes one backward)."""
    x = torch.randn(tokens, hidden, requires_grad=True)
    y = torch.randn(tokens, ffn, requires_grad=True)
    norm = torch.nn.LayerNorm(hidden)
    gx, gy = torch.ones(tokens, hidden), torch.ones(tokens, ffn)

    def layer():
        norm(x).backward(gx)
        torch.nn.functional.gelu(y).backward(gy)

    seconds = _timed(layer, repeats=7, best=True)
    return 5 * 4 * tokens * (hidden + ffn) / seconds / 1e9


def _link_rank(rank: int, path: str, out: str, sizes: tuple[int, ...]) -> None:
    """One of link()'s two ranks: all-reduces of each size, timed; rank 0 writes the seconds to ``out``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=LINK_TIMEOUT_S))
    results = []
    for n in sizes:
        x = torch.ones(n)
        results.append(_timed(lambda x=x: dist.all_reduce(x), repeats=7))
    if rank == 0:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(" ".join(map(str, results)))
    dist.destroy_process_group()


def link(sizes: tuple[int, int] = (1024, 1 << 22)) -> Link:
    """GB/s and latency between two ranks here: a 2-rank ring all-reduce of B bytes costs B / rate + 2 latency.
    The two ranks are fresh processes of this module (``python -m ptm_planner.measure RANK STORE OUT SIZES``),
    so the caller's own state (a test runner's, a notebook's) is never re-imported."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link")
        argv = [os.path.join(tmp, "store"), out, ",".join(map(str, sizes))]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([sys.executable, "-m", "ptm_planner.measure", str(r), *argv], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
        errors = [p.communicate(timeout=LINK_TIMEOUT_S)[1] for p in ranks]
        if any(p.returncode for p in ranks) or not os.path.exists(out):
            last = next((e.strip().splitlines()[-1] for e in errors if e.strip()), "no output")
            raise RuntimeError(f"measuring the link between two ranks here failed: {last}")
        with open(out, encoding="utf-8") as fh:
            small, large = map(float, fh.read().split())
    nbytes = [4 * n for n in sizes]
    per_byte = (large - small) / (nbytes[1] - nbytes[0])
    latency = max(0.0, (small - nbytes[0] * per_byte) / 2)
    return Link(1.0 / per_byte / 1e9, latency * 1e6)


def local_profile(ranks: int, threads: int = 1, nvme_path: str | None = None) -> ClusterProfile:
    """This machine, one rank of ``ranks`` per 'GPU', each with ``threads`` intra-op threads; the disk under
    ``nvme_path`` (default: the temporary folder)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rate, call = gemm_fit()
        copy = memory_gbps()
        acc = Accelerator("this machine's CPU (one rank)", peak_tflops=rate / 1e12, memory_gib=0.0,
                          memory_gbps=copy, gemm_efficiency=1.0, gemm_call_us=call * 1e6,
                          flash_efficiency=min(1.0, attention_rate() / rate),
                          memory_efficiency=min(1.0, elementwise_gbps() / copy))
        host_adam = measure_host_adam()
    finally:
        torch.set_num_threads(before)
    between = link()
    return ClusterProfile("local", f"this machine: {ranks} ranks of {threads} thread(s), gloo between them", acc,
                          gpus_per_node=ranks, intra=between, inter=between, pcie_gbps=acc.memory_gbps,
                          host_memory_gib=0.0, cpus=os.cpu_count() or 1, host_adam_elems_per_s=host_adam,
                          nvme_gbps=disk_gbps(nvme_path or tempfile.gettempdir()), nvme_free_gib=0.0,
                          source="measured here (ptm_planner/measure.py)", overlaps_comm=False,
                          expected_error=MEASURED_HERE_ERROR)


def local_speeds(profile: ClusterProfile) -> Speeds:
    """The offload lanes' speeds of a measured profile: on a CPU machine the 'device' is host memory too, so its
    Adam is the host's and its copies run at memory speed."""
    acc = profile.accelerator
    return Speeds(device_tflops=acc.peak_tflops, pcie_gbps=profile.pcie_gbps,
                  device_adam_elems_per_s=profile.host_adam_elems_per_s,
                  host_adam_elems_per_s=profile.host_adam_elems_per_s, ssd_gbps=profile.nvme_gbps, measured=("all",))


if __name__ == "__main__":  # one rank of link()
    _link_rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], tuple(int(n) for n in sys.argv[4].split(",")))
