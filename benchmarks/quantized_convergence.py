"""Do quantized ZeRO-3 collectives train as well as exact ones? The trainer on the bundled sample corpus, 4 ranks
laid out as 2 nodes x 2 (``zero_hpz_partition_size`` 2 makes the node), one run per layout, the loss curves compared.

    python -m benchmarks.quantized_convergence --iters 300 --out-dir benchmarks/results/quantized_convergence

Layouts: ``exact`` (flat ZeRO-3), ``zero++`` (hpZ secondary shards + int8 weight gathers + int4 gradient
exchange across nodes), ``zero++-int8`` (the same with int8 gradients), ``qwz`` and ``qgz`` (hpZ with only the
weights or only the gradients quantized; ``qgz-ef`` the latter with error feedback), and ``mics`` (exact MiCS
shard groups of 2: the same sums in another order, the size of the drift any change of rounding causes). Same
model, initial weights, data order and learning-rate schedule: every layout sees the same batches, so the
batch-to-batch noise is common to all. Prints per layout the final
loss (mean of the last 50 logged iterations) and its relative difference from the first layout; writes
``losses.csv`` and ``losses.png`` (the curves) to ``--out-dir``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.peer_workers.harness import torchrun

REPO = Path(__file__).resolve().parents[1]
LOSS = re.compile(r"^\s*iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
ZEROPP = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}
LAYOUTS = {"exact": {}, "zero++": {**ZEROPP, "quantized_gradients_bits": 4},
           "zero++-int8": {**ZEROPP, "quantized_gradients_bits": 8},
           "qwz": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True},
           "qgz": {"zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
           "qgz-ef": {"zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
                      "quantized_gradients_error_feedback": True},
           "mics": {"mics_shard_size": 2}}


def ds_config(zero: dict) -> dict:
    config = json.loads((REPO / "examples" / "ds_config_zero3.json").read_text())
    config["zero_optimization"].update(allgather_bucket_size=65_536, stage3_param_persistence_threshold=0, **zero)
    return config


def run(layout: str, iters: int, tmp: Path) -> list[tuple[int, float]]:
    config = tmp / f"ds_{layout}.json"
    config.write_text(json.dumps(ds_config(LAYOUTS[layout])))
    argv = [*torchrun(sys.executable, 4), "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "3e-3",
            "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.05", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--data-path", "data/sample/corpus_text_document", "--split", "98,2,0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "data/sample/vocab.json", "--merge-file",
            "data/sample/merges.txt", "--log-interval", "1", "--eval-interval", str(iters + 1), "--eval-iters", "0",
            "--distributed-backend", "gloo", "--seed", "1234", "--deepspeed", "--deepspeed_config", str(config)]
    proc = subprocess.run(argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    losses = [(int(m.group(1)), float(m.group(2))) for line in proc.stdout.splitlines() if (m := LOSS.match(line))]
    if proc.returncode or len(losses) != iters:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise SystemExit(f"benchmarks.quantized_convergence: the {layout} run failed (exit {proc.returncode}, "
                         f"{len(losses)} of {iters} iterations logged):\n{tail}")
    return losses


def final(losses: list[tuple[int, float]]) -> float:
    tail = [v for _, v in losses[-50:]]
    return sum(tail) / len(tail)


def plot(curves: dict[str, list[tuple[int, float]]], layouts: list[str], path: Path) -> None:
    """The loss curves, and under them each layout's loss relative to the first's (a 20-iteration mean: the
    batches are common to every layout, so their noise cancels in the ratio)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    base = [v for _, v in curves[layouts[0]]]
    for layout in layouts:
        its, values = [i for i, _ in curves[layout]], [v for _, v in curves[layout]]
        top.plot(its, values, label=layout, linewidth=1)
        rel = [(v - b) / b * 100 for v, b in zip(values, base)]
        smooth = [sum(rel[max(0, k - 19):k + 1]) / len(rel[max(0, k - 19):k + 1]) for k in range(len(rel))]
        bottom.plot(its, smooth, label=layout, linewidth=1)
    top.set_ylabel("lm loss")
    top.set_title("Sample corpus, 2 layers x 64, 4 ranks (2 nodes x 2)")
    top.legend()
    bottom.set_xlabel("iteration")
    bottom.set_ylabel(f"vs {layouts[0]}, % (20-iteration mean)")
    bottom.axhline(0, color="grey", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized_convergence",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--layouts", default="exact,zero++,zero++-int8")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    if unknown := [x for x in layouts if x not in LAYOUTS]:
        parser.error(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    if not (REPO / "data/sample/corpus_text_document.bin").exists():
        subprocess.run(["bash", "examples/prepare_sample_data.sh"], cwd=REPO, check=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    curves = {}
    with tempfile.TemporaryDirectory(prefix="ptm-qconv-") as tmp:
        for layout in layouts:
            print(f"{layout}: {args.iters} iterations ...", flush=True)
            curves[layout] = run(layout, args.iters, Path(tmp))
    base = final(curves[layouts[0]])
    print(f"| layout | final loss (mean of the last 50) | vs {layouts[0]} |\n|---|---|---|")
    for layout in layouts:
        value = final(curves[layout])
        print(f"| {layout} | {value:.4f} | {(value - base) / base * 100:+.2f}% |")
    with open(args.out_dir / "losses.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["iteration", *layouts])
        for i in range(args.iters):
            out.writerow([curves[layouts[0]][i][0], *(curves[x][i][1] for x in layouts)])
    plot(curves, layouts, args.out_dir / "losses.png")
    print(f"wrote {args.out_dir / 'losses.csv'} and {args.out_dir / 'losses.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
