"""The planner's step-time model against steps measured here: each configuration trains with pretrain_gpt.py on this
machine, and the model predicts it with this machine's profile, measured first (ptm_planner/measure.py).

    python -m benchmarks.planner_validation --rounds 2 --out benchmarks/results/planner_validation.md
    python -m benchmarks.planner_validation --configs ddp,zero3,tp2 --steps 4    # a few of them

Every configuration is one GPT (4 layers, hidden 512, 8 heads, seq 256, vocab 2048, fp32, no dropout: torch's
flash-style SDPA), a global batch of 8 sequences on 2 ranks of 1 thread each (gloo): data parallel 2 with 2
micro-batches of 2, or one replica split 2 ways (TP, PP, CP) with 4 micro-batches of 2. The ZeRO runs take the
planner's own config for their option (the JSON its plan would write). The figure is the median of the timed
steps (the trainer's "elapsed time per iteration" after the warm-up ones; with --rounds, of every round's, the
rounds interleaving the configurations). Groups of alternatives are ranked by
the model and by the measurement; the goals are each prediction within 20% and every group's predicted order equal
to the measured one.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ptm_planner.measure import local_profile, local_speeds
from ptm_planner.profiles import ClusterProfile
from ptm_planner.step_model import DataParallel, StepPrediction
from ptm_planner.step_time import Speeds

REPO = Path(__file__).resolve().parents[1]
GOAL = 0.20
MODEL = ("--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256")
# The same layers at a width where compute is nothing: its step is the trainer's own time on this machine.
BARE = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "256",
        "--max-position-embeddings", "256")
VOCAB = 2048
MICRO_BATCH, GLOBAL_BATCH, RANKS = 2, 8, 2
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...] = ()  # the trainer's and the planner's: mesh, layout, recompute, MoE
    zero: str | None = None  # None: the Megatron DDP backend; else the ZeRO-3 offload (none | cpu | nvme) or "1"
    groups: tuple[str, ...] = ()
    model: tuple[str, ...] = MODEL

    @property
    def replicas(self) -> int:
        split = 1
        for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
            if flag in self.flags:
                split *= int(self.flags[self.flags.index(flag) + 1])
        return RANKS // split

    @property
    def micro_batches(self) -> int:
        return GLOBAL_BATCH // (MICRO_BATCH * self.replicas)


MOE = ("--num-experts", "4", "--moe-router-topk", "2")
ZERO1 = {"zero_optimization": {"stage": 1}}
CONFIGS = [
    Config("ddp", groups=("data parallel and ZeRO", "recompute", "the split of 2 ranks")),
    Config("zero1", zero="1", groups=("data parallel and ZeRO",)),
    Config("zero3", zero="none", groups=("data parallel and ZeRO",)),
    Config("zero3-host", zero="cpu", groups=("data parallel and ZeRO",)),
    Config("zero3-ssd", zero="nvme", groups=("data parallel and ZeRO",)),
    Config("recompute-full", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1"), groups=("recompute",)),
    Config("recompute-selective", ("--recompute-granularity", "selective"), groups=("recompute",)),
    Config("tp2", ("--tensor-model-parallel-size", "2"), groups=("tensor parallel", "the split of 2 ranks")),
    Config("tp2-sp", ("--tensor-model-parallel-size", "2", "--sequence-parallel"), groups=("tensor parallel",)),
    Config("pp2", ("--pipeline-model-parallel-size", "2"), groups=("pipeline", "the split of 2 ranks")),
    Config("pp2-interleaved", ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                               "1"), groups=("pipeline",)),
    Config("cp2-p2p", ("--context-parallel-size", "2", "--cp-comm-type", "p2p"),
           groups=("context parallel", "the split of 2 ranks")),
    Config("cp2-a2a", ("--context-parallel-size", "2", "--cp-comm-type", "a2a"), groups=("context parallel",)),
    Config("cp2-allgather", ("--context-parallel-size", "2", "--cp-comm-type", "allgather"),
           groups=("context parallel",)),
    Config("moe-ep2", (*MOE, "--expert-model-parallel-size", "2"), groups=("experts",)),
    Config("moe-ep1", MOE, groups=("experts",)),
]


@dataclass
class Row:
    config: Config
    predicted: StepPrediction | None = None
    measured_s: float | None = None
    error: str = ""
    steps: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or self.measured_s is None:
            return None
        return self.predicted.step_s / self.measured_s - 1


def planner_argv(c: Config) -> list[str]:
    """The request as ptm-plan takes it (a CPU plan for 2 processes here; it takes the trainer's flags)."""
    return [*c.model, *c.flags, "--vocab-size", str(VOCAB), "--micro-batch-size", str(MICRO_BATCH),
            "--gradient-accumulation-steps", str(c.micro_batches), "--nproc-per-node", str(RANKS), "--device", "cpu",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--host-memory-gib", "16", "--nvme-free-gib", "40",
            "--nvme-path", os.path.join(tempfile.gettempdir(), "ptm_validation_nvme")]


def plan(c: Config, profile: ClusterProfile, speeds: Speeds, host_s: float = 0.0) -> tuple[StepPrediction, dict | None]:
    """The model's step for ``c`` (with ``host_s`` of the trainer's own time a step) and, for a ZeRO run, the
    config the planner would write for it."""
    from ptm_planner.cli import request_from_args
    from ptm_planner.plan import Option, Planner

    request = request_from_args(planner_argv(c))[0]
    request = dataclasses.replace(request, profile=profile, speeds=speeds)
    planner = Planner(request)
    offload = c.zero if c.zero in ("none", "cpu", "nvme") else "none"
    page = planner.pages[0]
    option = Option(offload, page, MICRO_BATCH, request.recompute_forced, planner.sub_group_sizes(page, offload)[0])
    ev = planner.evaluate(option)
    work = dataclasses.replace(planner.workload(ev), host_overhead_s=host_s)
    if c.zero is None or c.zero == "1":  # the DDP backend, or ZeRO-1's reduce-scatter + all-gather: the same bytes
        work = dataclasses.replace(work, data_parallel=DataParallel("ddp", overlap=True, grad_bytes=4))
        return planner.predict(ev, work), ZERO1 if c.zero == "1" else None
    return planner.predict(ev, work), ev.config


def trainer_argv(c: Config, steps: int, config_path: str | None) -> list[str]:
    argv = [*c.model, *c.flags, "--vocab-size", str(VOCAB - 1), "--make-vocab-size-divisible-by", "128",
            "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(steps), "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--distributed-backend", "gloo"]
    if config_path:
        argv += ["--deepspeed", "--deepspeed_config", config_path]
    return argv


def measure(c: Config, steps: int, warmup: int, config: dict | None, timeout_s: float) -> tuple[list[float], str]:
    """Seconds of the timed steps of one run, or the failure's last line."""
    with tempfile.TemporaryDirectory(prefix="ptm-validation-") as tmp:
        path = None
        if config is not None:
            path = os.path.join(tmp, "ds.json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(config, fh)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               str(REPO / "pretrain_gpt.py"), *trainer_argv(c, warmup + steps, path)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tmp, env=env)
        except subprocess.TimeoutExpired:
            return [], f"cut at {timeout_s:.0f} s"
        times = [(int(m.group(1)), float(m.group(2)) / 1e3) for m in LINE.finditer(out.stdout + out.stderr)]
        timed = [t for i, t in times if i > warmup]
        if out.returncode or len(timed) < steps:
            tail = (out.stderr or out.stdout).strip().splitlines()
            return timed, f"exit {out.returncode}: {tail[-1] if tail else 'no output'}"
        return timed, ""


def ranking_lines(rows: list[Row]) -> tuple[list[str], bool]:
    """Per group: the predicted and the measured order, fastest first; whether every group agrees."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        for g in r.config.groups:
            groups.setdefault(g, []).append(r)
    lines, all_right = [], True
    for g, members in groups.items():
        done = [r for r in members if r.ratio is not None]
        if len(done) < 2:
            continue
        predicted = [r.config.name for r in sorted(done, key=lambda r: r.predicted.step_s)]
        measured = [r.config.name for r in sorted(done, key=lambda r: r.measured_s)]
        fastest = min(done, key=lambda r: r.measured_s)
        chosen = min(done, key=lambda r: r.predicted.step_s)
        slower = chosen.measured_s / fastest.measured_s - 1
        right = predicted == measured
        all_right &= right
        lines.append(f"| {g} | {' < '.join(predicted)} | {' < '.join(measured)} | {'yes' if right else 'NO'} | "
                     f"{chosen.config.name}: {slower:+.1%} |")
    return lines, all_right


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every configuration, interleaved; the "
                                                               "figure is the median of all their timed steps")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    by_name = {c.name: c for c in CONFIGS}
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in by_name]:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(by_name)}")
    profile = local_profile(RANKS, threads=1)
    acc = profile.accelerator
    speeds = local_speeds(profile)
    measured_line = (f"This machine, measured per rank (1 thread): fp32 GEMMs {acc.peak_tflops * 1e3:.1f} GFLOP/s + "
                     f"{acc.gemm_call_us:.0f} us a call; causal SDPA at {acc.flash_efficiency:.2f} of that; memory "
                     f"{acc.memory_gbps:.1f} GB/s; gloo between 2 ranks {profile.intra.gbps:.2f} GB/s + "
                     f"{profile.intra.latency_us:.0f} us; host Adam {profile.host_adam_elems_per_s:.3g} elements/s.")
    bare = Config("the trainer's own time", model=BARE)
    bare_pred = plan(bare, profile, speeds)[0]
    bare_steps, error = measure(bare, args.steps, args.warmup, None, args.timeout_s)
    if error:
        print(f"benchmarks.planner_validation: error: the bare run failed: {error}", file=sys.stderr)
        return 1
    host_s = max(0.0, statistics.median(bare_steps) - bare_pred.step_s)
    measured_line += (f" The trainer's own time a step: {host_s:.3f} s (the same layers at hidden 64 measured "
                      f"{statistics.median(bare_steps):.3f} s, the model's compute for them {bare_pred.step_s:.3f} s).")
    print(measured_line, flush=True)
    rows, configs = [], {}
    for name in names:
        row = Row(by_name[name])
        try:
            row.predicted, configs[name] = plan(row.config, profile, speeds, host_s)
        except (ValueError, RuntimeError) as e:
            row.error = f"planner: {e}"
        rows.append(row)
    for round_ in range(args.rounds):  # rounds interleave the configurations, so a slow spell hits them alike
        for row in rows:
            if row.predicted is None or row.error:
                continue
            steps, row.error = measure(row.config, args.steps, args.warmup, configs[row.config.name], args.timeout_s)
            row.steps += steps
            row.measured_s = statistics.median(row.steps) if row.steps else None
            print(f"round {round_ + 1} {row.config.name}: predicted {row.predicted.step_s:.2f} s, measured "
                  f"{'-' if row.measured_s is None else f'{row.measured_s:.2f}'} s {row.error}", flush=True)
    table = ["| configuration | micro-batches | predicted s/step | measured s/step | error | within 20% |",
             "|---|---|---|---|---|---|"]
    worst = 0.0
    for r in rows:
        if r.ratio is None:
            table.append(f"| {r.config.name} | {r.config.micro_batches} | "
                         f"{'-' if r.predicted is None else f'{r.predicted.step_s:.2f}'} | failed: {r.error} | | |")
            continue
        worst = max(worst, abs(r.ratio))
        table.append(f"| {r.config.name} | {r.config.micro_batches} | {r.predicted.step_s:.2f} | "
                     f"{r.measured_s:.2f} | {r.ratio:+.1%} | {'yes' if abs(r.ratio) <= GOAL else 'NO'} |")
    ranks, all_right = ranking_lines(rows)
    text = "\n".join([
        f"Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; load before: {os.getloadavg()[0]:.2f}", "",
        f"Command: `python -m benchmarks.planner_validation {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "", measured_line, "", *table, "",
        f"Largest error: {worst:.1%} (goal {GOAL:.0%}).", "",
        "| group | predicted order | measured order | same | the predicted fastest against the measured fastest |",
        "|---|---|---|---|---|", *ranks, "",
        f"Every group's order as measured: {'yes' if all_right else 'NO'}.", ""])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
