"""``--compile`` against eager: tokens/s, compile time and losses of the same ZeRO-3 run.

    python -m benchmarks.compile_speed [--layers 12 --hidden 768 --heads 12 --seq 256 --micro-batch 2 --steps 20]

``pretrain_gpt.py`` on 2 CPU ranks (gloo, fp32) with the zero_cache engine's ZeRO-3, eager, eager without
gradient-accumulation fusion (which ``--compile`` turns off: the compiled layers return weight gradients through
autograd) and with ``--compile``, alternated ``--repeats`` times. From each run's per-iteration log lines: the
median step time of iterations 3 to the end (tokens/s from it), the first iteration's time beyond eager's (what
compiling costs), and the largest relative difference of the loss from the eager run's over every iteration.
The defaults are the 110M GPT (vocabulary 50304) and take about 15 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ITERATION = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+).*?lm loss: ([\d.E+-]+)")


VARIANTS = {"eager": [], "eager, no fusion": ["--no-gradient-accumulation-fusion"], "--compile": ["--compile"]}


def run(a, variant: str, ds_config: str) -> dict[int, tuple[float, float]]:
    """{iteration: (ms, loss)} of one run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(a.port),
           "pretrain_gpt.py", "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
           "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq), "--max-position-embeddings",
           str(a.seq), "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(2 * a.micro_batch),
           "--train-iters", str(a.steps), "--lr", "3e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "50257", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
           "--eval-iters", "0", "--num-workers", "0", "--distributed-backend", "gloo",
           "--deepspeed", "--deepspeed_config", ds_config] + VARIANTS[variant]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    found = {int(m[1]): (float(m[2]), float(m[3])) for m in ITERATION.finditer(out.stdout)}
    if out.returncode or len(found) != a.steps:
        tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
        raise SystemExit(f"compile_speed: the {variant} run failed (exit "
                         f"{out.returncode}): {' | '.join(tail)}")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="the first is the baseline")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--port", type=int, default=29641)
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ds = os.path.join(tmp, "ds.json")
        with open(ds, "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": a.micro_batch, "zero_optimization": {"stage": 3}}, f)
        runs: dict[str, list[dict]] = {v: [] for v in a.variants}
        for _ in range(a.repeats):
            for v in a.variants:
                runs[v].append(run(a, v, ds))
    tokens = 2 * a.micro_batch * a.seq
    step = {v: statistics.median(ms for r in runs[v] for it, (ms, _) in r.items() if it >= 3) for v in runs}
    first = {v: statistics.median(r[1][0] for r in runs[v]) for v in runs}
    base = a.variants[0]
    print(f"\n{a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch {a.micro_batch} x 2 ranks, ZeRO-3, "
          f"fp32, {a.steps} iterations x {a.repeats} runs each, {os.cpu_count()} CPU cores\n")
    print(f"| run | median step (ms) | tokens/s | vs {base} | first iteration (ms) | largest loss difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for v in runs:
        drift = max(abs(o[it][1] - e[it][1]) / abs(e[it][1]) for e, o in zip(runs[base], runs[v]) for it in e)
        print(f"| {v} | {step[v]:.0f} | {1000 * tokens / step[v]:.0f} | {step[base] / step[v]:.2f}x | "
              f"{first[v]:.0f} | {drift:.1e} |")
    if "--compile" in runs:
        extra = (first["--compile"] - first[base]) / 1000
        print(f"\ncompile time (the first iteration beyond {base}'s): {extra:.1f} s")


if __name__ == "__main__":
    main()
