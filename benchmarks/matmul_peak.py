"""The machine's own matmul ceiling, the figure MFU is measured against (gpu_check.sh's preflight).

    python -m benchmarks.matmul_peak                          # 8192^3 bf16 on cuda:0: median TFLOP/s
    python -m benchmarks.matmul_peak --device cpu --size 512 --dtype fp32 --seconds 1 --json peak.json

Square matmuls back to back for ``--warmup-s`` seconds first (clocks up, then settled at what the power and
heat allow; cuBLAS heuristics chosen), then ``--samples`` groups sized so that together they take about
``--seconds`` (CUDA events around each group on a GPU, the wall clock on a CPU); the figure is the median
group, with the spread beside it. A datasheet peak assumes boost clocks and ideal kernels; the median of a
sustained run of several seconds on this very machine is what a training step can actually approach (a
fraction of a second of matmuls measures the boost clock).
Also prints (and writes with ``--json``) what the machine is: device name and memory, torch, CUDA, python.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

from benchmarks.one_line_args import OneLineParser

DTYPES = ("bf16", "fp16", "fp32")
DATASHEET_TFLOPS = 989.0  # H100/H200 SXM bf16 dense, no sparsity: the second MFU figure beside the measured one


def machine(device: str) -> dict:
    """What the figures were measured on (device name and memory, library versions)."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cores": os.cpu_count(),
            "host": platform.node()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                    sms=props.multi_processor_count)
    else:
        info.update(device=platform.processor() or platform.machine())
    return info


def measure(device: str, dtype: str, size: int, warmup_s: float, samples: int, seconds: float
            ) -> tuple[list[float], int]:
    """TFLOP/s of each of ``samples`` timed groups of matmuls of two size x size matrices, and the matmuls per
    group (sized from the warm-up's speed so that the groups take about ``seconds`` in all)."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dt, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dt, generator=gen)
    out = torch.empty(size, size, device=device, dtype=dt)
    cuda = device == "cuda"

    def timed(n: int) -> float:
        """Seconds of ``n`` matmuls back to back."""
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(a, b, out=out)
        return time.perf_counter() - t0

    n, spent, one = 1, 0.0, timed(1)
    while spent < warmup_s:  # groups growing to about 0.1 s, so the warm-up runs back to back
        took = timed(n)
        spent, one = spent + took, took / n
        n = max(1, min(2 * n, int(0.1 / max(one, 1e-9))))
    per_sample = max(1, round(seconds / samples / max(one, 1e-9)))
    flops = 2.0 * size ** 3 * per_sample
    return [flops / timed(per_sample) / 1e12 for _ in range(samples)], per_sample


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m benchmarks.matmul_peak", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--size", type=int, default=8192, help="matrix side (default 8192)")
    p.add_argument("--warmup-s", type=float, default=2.0, help="seconds of untimed matmuls first (default 2)")
    p.add_argument("--samples", type=int, default=15, help="timed groups; the median is the figure")
    p.add_argument("--seconds", type=float, default=6.0, help="the timed groups' seconds in all (default 6)")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    if min(a.size, a.samples) < 1 or a.warmup_s < 0 or a.seconds <= 0:
        p.error("--size and --samples must be >= 1, --warmup-s >= 0 and --seconds > 0")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("matmul_peak: error: no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rates, per_sample = measure(a.device, a.dtype, a.size, a.warmup_s, a.samples, a.seconds)
    result = {"machine": machine(a.device), "dtype": a.dtype, "size": a.size, "samples": len(rates),
              "per_sample": per_sample, "warmup_s": a.warmup_s, "seconds": time.perf_counter() - t0,
              "median_tflops": statistics.median(rates), "min_tflops": min(rates), "max_tflops": max(rates),
              "tflops": rates}
    m = result["machine"]
    print(f"{m['device']}: {a.dtype} {a.size}^3 matmul median {result['median_tflops']:.4g} TFLOP/s "
          f"(min {result['min_tflops']:.4g}, max {result['max_tflops']:.4g}; {len(rates)} x {per_sample} after "
          f"{a.warmup_s:g} s of warm-up, {result['seconds']:.1f} s in all); torch {m['torch']}, python {m['python']}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
