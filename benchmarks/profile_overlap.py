"""Do host <-> device copies run under compute? The share of copy time that a torch.profiler trace shows
beside the compute kernels.

    python -m benchmarks.profile_overlap --out DIR        # profile 3 steps of an MLP stack with host offload (GPU)
    python -m benchmarks.profile_overlap --trace T.json   # read a trace someone else wrote (any machine)

How a trace is read: benchmarks/trace_overlap.py. The check passes when some copy time was hidden.

Who writes traces: the peer workers' profiled steps (``BenchSpec.profile_steps``; gpu_check.sh's offload stage
profiles ours and FSDP2's CPU offload on the 1.3B GPT, one step each after the timed ones) read them with
``report_from_trace``; ``--out`` profiles a stand-alone model: one process, ZeRO-3 with parameters and optimizer
states in pinned host memory, bf16, a stack of MLP blocks (benchmarks/bench_overlap.py's model), two
micro-batches per step, two untimed steps and three under the profiler, the trace kept as
``DIR/overlap_trace.json``.
Exit status 0 passes, 1 fails (the line says why), 2 no GPU (--out) or an unreadable trace (--trace).
"""
from __future__ import annotations

import os
import sys

from benchmarks.one_line_args import OneLineParser
from benchmarks.trace_overlap import report_from_trace


def _profile(args) -> str:
    """Profile the MLP stack; the trace's path."""
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
    return path


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m benchmarks.profile_overlap", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="profile the MLP stack here (GPU): the trace is DIR/overlap_trace.json")
    where.add_argument("--trace", help="only read this Chrome trace")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.trace:
        try:
            report = report_from_trace(args.trace)
        except (OSError, ValueError, KeyError) as e:
            print(f"profile_overlap: error: cannot read the trace {args.trace} ({e})", file=sys.stderr)
            return 2
    else:
        import torch
        if not torch.cuda.is_available():
            print("profile_overlap: no CUDA device", file=sys.stderr)
            return 2
        os.makedirs(args.out, exist_ok=True)
        report = report_from_trace(_profile(args))
    print(f"overlap: {report.line()}")
    if not report.concurrent:
        print("overlap: FAIL: no copy time ran beside compute kernels", file=sys.stderr)
        return 1
    print("overlap: PASS: copy time ran beside compute kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
