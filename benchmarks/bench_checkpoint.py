"""Checkpoint cost seen by training: a synchronous save against ``--async-save`` of the same state, and the load.

    python -m benchmarks.bench_checkpoint [--layers 12 --hidden 768 --heads 12 --nproc 2 --deepspeed cpu]

Three runs of ``pretrain_gpt.py`` (torchrun, ``--nproc`` ranks, fp32 on CPU / bf16 on CUDA, synthetic tokens):
a synchronous run and an ``--async-save`` run, each saving every other iteration, and a resume of the last
one. For every save the trainer logs how long the loop was blocked and how long the write took; the table
gives their medians, the step time, the whole run's wall time (start-up included), the load time, and the
peak resident memory of the whole process tree during each run
(sampled every 50 ms). ``--deepspeed cpu|nvme|none`` trains through the zero_cache engine with states in host
memory or on SSD (``--nvme-path``), or with plain data parallelism. Raw logs: ``benchmarks/logs/``; the table:
``benchmarks/results/checkpoint.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SAVE = re.compile(r"saved checkpoint at iteration (\d+) .*?written in ([0-9.]+) s, training blocked ([0-9.]+) s")
_LOAD = re.compile(r"loaded checkpoint \S+ in ([0-9.]+) s")
_STEP = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def _argv(a, ckpt: str, iters: int) -> list[str]:
    argv = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(a.nproc), "--train-iters", str(iters), "--lr", "1e-4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--save", ckpt, "--load", ckpt, "--save-interval", str(a.save_interval)]
    if a.deepspeed != "none":
        device = {"device": a.deepspeed, "nvme_path": a.nvme_path}
        config = os.path.join(a.log_dir, f"ds_{a.deepspeed}.json")
        with open(config, "w", encoding="utf-8") as f:
            json.dump({"zero_optimization": {"stage": 3, "offload_optimizer": device, "offload_param": device}}, f)
        argv += ["--deepspeed", "--deepspeed_config", config]
    return argv


def _run(argv: list[str], nproc: int, log: str) -> tuple[str, float, float]:
    """Run the trainer; returns its output, the peak RSS (GiB) of its process tree and the wall seconds."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # a venv over a machine's torch has no bin/torchrun
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([*torchrun, "--standalone", f"--nproc-per-node={nproc}", "pretrain_gpt.py", *argv],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        root, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [root] + root.children(recursive=True)))
            except psutil.Error:
                pass
            time.sleep(0.05)
    text = open(log, encoding="utf-8").read()
    if proc.returncode != 0:
        raise SystemExit(f"bench_checkpoint: the trainer failed (exit {proc.returncode}); see {log}")
    return text, peak / 2**30, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--deepspeed", choices=["none", "cpu", "nvme"], default="cpu")
    p.add_argument("--nvme-path", default="/tmp/bench_checkpoint_nvme")
    p.add_argument("--ckpt-dir", default="/tmp/bench_checkpoint", help="where the checkpoints go (removed first)")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "benchmarks", "logs", "checkpoint"))
    p.add_argument("--table", default=os.path.join(ROOT, "benchmarks", "results", "checkpoint.md"))
    a = p.parse_args(argv)
    os.makedirs(a.log_dir, exist_ok=True)
    rows = []
    for mode in ("sync", "async"):
        ckpt = os.path.join(a.ckpt_dir, mode)
        shutil.rmtree(ckpt, ignore_errors=True)
        extra = ["--async-save"] if mode == "async" else []
        out, peak, wall = _run(_argv(a, ckpt, a.iters) + extra, a.nproc, os.path.join(a.log_dir, f"{mode}.log"))
        saves = [(float(w), float(b)) for _, w, b in _SAVE.findall(out)]
        steps = [float(s) for s in _STEP.findall(out)][1:]
        rows.append((mode, len(saves), statistics.median(b for _, b in saves),
                     statistics.median(w for w, _ in saves), statistics.median(steps) / 1000, wall, peak))
    out, peak, _ = _run(_argv(a, os.path.join(a.ckpt_dir, "async"), a.iters + 1), a.nproc,
                     os.path.join(a.log_dir, "load.log"))
    load_s = float(_LOAD.search(out).group(1))
    params = re.search(r"model: ([0-9.]+)M parameters", out).group(1)
    lines = [f"# Checkpoint cost: {params}M-parameter GPT, {a.nproc} ranks, "
             f"{'zero_cache ZeRO-3, states ' + a.deepspeed if a.deepspeed != 'none' else 'plain DDP'}",
             "", f"`python -m benchmarks.bench_checkpoint --layers {a.layers} --hidden {a.hidden} --heads {a.heads} "
             f"--nproc {a.nproc} --deepspeed {a.deepspeed}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", "| save | saves | training blocked per save (s, median) | write (s, median) | s/step (median) "
             "| whole run (s) | peak RSS, all ranks (GiB) |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {m} | {n} | {b:.2f} | {w:.2f} | {s:.2f} | {t:.1f} | {r:.2f} |" for m, n, b, w, s, t, r in rows]
    lines += ["", f"Load of the last checkpoint: {load_s:.2f} s, peak RSS {peak:.2f} GiB (all ranks)."]
    table = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(a.table), exist_ok=True)
    with open(a.table, "w", encoding="utf-8") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
