"""GPU check: do host <-> device copies run concurrently with compute kernels? A torch.profiler trace of three
steps with host offload, then the share of the copy time that overlapped compute.

    python -m benchmarks.profile_overlap --out DIR      # on a GPU machine (benchmarks/gpu_check.sh stage 4)

One process, ZeRO-3 with parameters and optimizer states in pinned host memory (offload cpu), bf16, a stack
of MLP blocks (benchmarks/bench_overlap.py's model), two micro-batches per step; two untimed steps, then
three under ``torch.profiler`` (CUDA activity). The trace (``DIR/overlap_trace.json``) is read back: the
host-to-device and device-to-host memcpy kernels, and the compute kernels. Hidden share = the copy time
that lies inside the union of the compute kernels' intervals (kernels on streams without copies) over the
total copy time. The check passes when some copy time overlapped compute; copies issued on the compute
stream would leave no compute kernel to overlap and fail it.
Exit status 0 passes, 1 fails (the line says why), 2 no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

COPY_KINDS = ("HtoD", "DtoH")


@dataclass(frozen=True)
class OverlapReport:
    copies: int
    kernels: int
    copy_seconds: float
    hidden_seconds: float  # copy time during which some compute kernel ran
    copy_streams: tuple[int, ...]
    compute_streams: tuple[int, ...]

    @property
    def hidden(self) -> float:
        return self.hidden_seconds / self.copy_seconds if self.copy_seconds > 0 else 0.0

    @property
    def concurrent(self) -> bool:
        """Copies ran on streams of their own and some of their time overlapped compute kernels."""
        return bool(self.copies) and bool(self.kernels) and self.hidden > 0

    def line(self) -> str:
        return (f"{self.copies} host<->device copies on streams {list(self.copy_streams)}, {self.kernels} compute "
                f"kernels on streams {list(self.compute_streams)}: copy time {self.copy_seconds * 1e3:.1f} ms, "
                f"{self.hidden_seconds * 1e3:.1f} ms of it concurrent with compute ({100 * self.hidden:.0f}% hidden)")


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
    """Copies against compute kernels in a Chrome trace's ``traceEvents`` (times in microseconds)."""
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
    # Compute = kernels on streams without host<->device copies (a copy with a dtype change runs its conversion
    # kernel on the copy stream; copies on the compute stream would leave no compute stream at all).
    copy_streams = {s for *_, s in copies}
    kernels = [k for k in kernels if k[2] not in copy_streams]
    union = _union([(a, b) for a, b, _ in kernels])
    total = sum(b - a for a, b, _ in copies)
    hidden = sum(_covered(a, b, union) for a, b, _ in copies)
    return OverlapReport(len(copies), len(kernels), total / 1e6, hidden / 1e6, tuple(sorted(copy_streams, key=str)),
                         tuple(sorted({s for *_, s in kernels}, key=str)))


def _profile(args) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import zero_cache
    from benchmarks.bench_overlap import Stack

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = Stack(args.layers, args.hidden).to(device=device, dtype=torch.bfloat16)
    layer = 8 * args.hidden * args.hidden + 7 * args.hidden
    where = {"device": "cpu", "pin_memory": True}
    cfg = {"train_batch_size": 2 * args.micro_batch, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "allgather_bucket_size": layer, "sub_group_size": layer,
                                 "stage3_param_persistence_threshold": 4 * args.hidden,
                                 "stage3_prefetch_bucket_size": layer, "stage3_max_reuse_distance": 0,
                                 "offload_optimizer": dict(where), "offload_param": dict(where)}}
    engine = zero_cache.initialize(model=model, config=cfg)

    def step():
        for _ in range(2):
            x = torch.randn(args.micro_batch, args.seq, args.hidden, device=device, dtype=torch.bfloat16)
            engine.backward(engine(x))
        engine.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(f"engine copy report of the last step: {engine.copy_stats()}")
    engine.close()
    path = os.path.join(args.out, "overlap_trace.json")
    prof.export_chrome_trace(path)
    with open(path, encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder of the trace")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("profile_overlap: no CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    report = overlap_report(_profile(args))
    print(f"overlap: {report.line()}")
    if not report.concurrent:
        print("overlap: FAIL: copies did not run concurrently with compute kernels", file=sys.stderr)
        return 1
    print("overlap: PASS: copy kernels ran concurrently with compute kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
