"""Our ZeRO-3 against PyTorch FSDP2 (and DeepSpeed where it is installed) on one GPU, in one run: tokens/s,
TFLOP/s and MFU against the machine's measured matmul peak, peak memory, losses, and with host offload the
share of copy time hidden under compute (gpu_check.sh stages 3 and 4).

    python -m benchmarks.gpu_peers --peak-json peak.json                    # dense 1.3B bf16 on cuda:0
    python -m benchmarks.gpu_peers --systems ours-offload fsdp2-offload --steps 3 --profile-steps 1
    python -m benchmarks.gpu_peers --device cpu --preset tiny               # the plumbing, on CPU + gloo, fp32

Systems, each its own torchrun job (one process per rank, over the loopback address), in the order given (the
default puts the like-for-like pair first: the same loop, our engine against FSDP2):

    ours[-offload]          benchmarks/peer_workers: zero_cache.initialize in the workers' shared loop
    fsdp2[-offload]         peer worker: fully_shard per layer; MixedPrecisionPolicy in bf16; CPUOffloadPolicy;
                            reshard_after_forward only with more than one rank
    ours-trainer[-offload]  pretrain_gpt.py --deepspeed: zero_cache ZeRO-3 through the trainer (the product path)
    megatron                pretrain_gpt.py without --deepspeed: Megatron's DDP + mixed-precision AdamW (on one
                            GPU nothing is sharded: this is the baseline a single GPU is measured against)
    deepspeed[-offload]     peer worker: DeepSpeed ZeRO-3, only where `import deepspeed` works (else "not installed")
    ddp                     peer worker: DDP, the fp32 loss reference

Every system trains the same GPTModel from the same seeded weights on the trainer's --mock-data batches with
the same AdamW (constant LR, clipping), so the losses of every step must agree (within --loss-rtol; bf16 has
its rounding). A job's steps: --warmup untimed, --steps timed (the figures: medians), then --profile-steps
under torch.profiler (workers only) whose trace gives the copy time that ran under compute kernels.
Jobs share --budget-s in the order given: each may run for --job-timeout-s or what is left, whichever is
less, and a job that would get less than --min-job-s is not started (its row says so): the later systems
run if time allows. A job cut by its time is "incomplete", not failed: its row has the steps it did and their
times. A failed or incomplete job keeps the last 40 lines of its log in the JSON. The JSON (--json) is rewritten
after every job, so a run cut short keeps what it measured; SIGTERM ends the running job and writes it too.

MFU counts the model's FLOPs per token as Megatron does: 6 x the matmul parameters plus 12 x layers x seq x
hidden for attention, the causal mask's skipped half counted in full. Each row's "planner predicted / measured"
is the planner's predicted step (ptm_planner/step_model.py) for our engine on this model and offload, with the
measured matmul peak as the large-GEMM rate, over the row's median step.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from benchmarks.matmul_peak import DATASHEET_TFLOPS
from benchmarks.one_line_args import OneLineParser
from benchmarks.peer_workers.harness import (
    BETAS,
    EPS,
    LOGS_DIR,
    BenchSpec,
    Terminated,
    cut_reason,
    first_error,
    fresh_job_dir,
    log_tail,
    mock_trainer_flags,
    raise_on_sigterm,
    run_job,
    terminated,
    torchrun,
    worker_cmd,
    worker_env,
)

# name -> layers, hidden, heads, tokenizer vocabulary (NullTokenizer; the model pads vocab + eod), seq, micro-batch
PRESETS = {
    "1.3b": (24, 2048, 16, 32000, 2048, 4),
    "tiny": (2, 256, 4, 8000, 128, 2),
}
# zero_cache chunk size per preset: about one transformer layer, as the planner picks for the 1.3B on one GPU
# (a 5e8 default would gather the whole model in two chunks and leave nothing to prefetch behind compute).
PAGE = {"1.3b": 50_331_648, "tiny": 500_000}


@dataclass(frozen=True)
class System:
    key: str
    name: str
    kind: str  # trainer | worker
    impl: str  # worker --impl, or the trainer's backend: zero_cache (--deepspeed) | megatron
    offload: bool


SYSTEMS = {s.key: s for s in [
    System("ours-trainer", "ours: pretrain_gpt.py --deepspeed (zero_cache ZeRO-3)", "trainer", "zero_cache", False),
    System("ours-trainer-offload", "ours: pretrain_gpt.py --deepspeed + host offload", "trainer", "zero_cache", True),
    System("megatron", "Megatron backend: pretrain_gpt.py (DDP, no sharding)", "trainer", "megatron", False),
    System("ours", "ours: zero_cache ZeRO-3 (peer worker)", "worker", "ours", False),
    System("ours-offload", "ours: zero_cache ZeRO-3 + host offload", "worker", "ours", True),
    System("fsdp2", "FSDP2 (fully_shard)", "worker", "fsdp2", False),
    System("fsdp2-offload", "FSDP2 + CPUOffloadPolicy", "worker", "fsdp2", True),
    System("deepspeed", "DeepSpeed ZeRO-3", "worker", "deepspeed", False),
    System("deepspeed-offload", "DeepSpeed ZeRO-3 + CPU offload", "worker", "deepspeed", True),
    System("ddp", "DDP", "worker", "ddp", False),
]}
# Loss references, first present wins: fp32 DDP; else the peer itself (in bf16 the Megatron backend's fp32
# main-grad accumulation rounds differently from ours and FSDP2's, which agree more closely with each other).
REFERENCES = ("ddp", "fsdp2", "fsdp2-offload", "megatron")
PEERS = ("fsdp2", "deepspeed")  # the rows ours is divided by, same offload


@dataclass
class JobResult:
    key: str
    name: str
    status: str = "not run"  # ok | failed | incomplete (cut by its time) | not run | not installed
    error: str = ""
    step_s: list[float] = field(default_factory=list)  # every step, warm-up included (slowest rank)
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    peak_device_gib: float = 0.0
    peak_rss_gib: float = 0.0
    overlap: dict | None = None  # the profiled steps' copy/compute overlap (rank 0)
    log: str = ""
    log_tail: list[str] = field(default_factory=list)  # a failed or incomplete job's last log lines

    @property
    def fixed_s(self) -> float:
        """The job's seconds outside its steps: process start, imports, rendezvous, model build, teardown."""
        return max(0.0, self.wall_s - sum(self.step_s))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m benchmarks.gpu_peers", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="1.3b (default on cuda) or tiny (cpu)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), metavar="SYSTEM",
                   default=["ours", "fsdp2", "ours-trainer", "megatron", "deepspeed"],
                   help=f"rows in order, of: {' '.join(SYSTEMS)}")
    p.add_argument("--seq", type=int, help="default: the preset's")
    p.add_argument("--micro-batch", type=int, help="default: the preset's")
    p.add_argument("--global-batch", type=int, help="default: micro-batch x ranks")
    p.add_argument("--steps", type=int, default=6, help="timed steps (medians)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--profile-steps", type=int, default=0, help="steps under torch.profiler after the timed ones")
    p.add_argument("--nproc", type=int, default=1, help="ranks (one GPU each on cuda)")
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores / ranks)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-tflops", type=float, help="the measured matmul peak MFU is taken against")
    p.add_argument("--peak-json", help="benchmarks.matmul_peak --json output: its median is the peak (and its "
                                       "device memory the planner's)")
    p.add_argument("--datasheet-tflops", type=float, default=None,
                   help=f"second MFU column (default {DATASHEET_TFLOPS:g} on cuda: H100/H200 bf16 dense)")
    p.add_argument("--loss-rtol", type=float, help="allowed relative loss difference per step (default: fp32 "
                                                   "1e-4, bf16 1e-2)")
    p.add_argument("--reference-from", help="a previous --json of this script: compare losses with its reference "
                                            "system's (over the steps both ran) instead of a row of this run")
    p.add_argument("--budget-s", type=float, default=1800, help="seconds for all jobs together")
    p.add_argument("--job-timeout-s", type=float, default=600, help="the most seconds one job may run")
    p.add_argument("--min-job-s", type=float, default=30, help="a job with less time left is not started")
    p.add_argument("--run-dir", help="jobs' logs and results (default: a new folder under benchmarks/logs/)")
    p.add_argument("--json", help="write the results here (after every job)")
    a = p.parse_args(argv)
    a.preset = a.preset or ("1.3b" if a.device == "cuda" else "tiny")
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.threads = a.threads or max(1, (os.cpu_count() or 1) // a.nproc)
    a.loss_rtol = a.loss_rtol if a.loss_rtol is not None else (1e-2 if a.dtype == "bf16" else 1e-4)
    if a.datasheet_tflops is None and a.device == "cuda":
        a.datasheet_tflops = DATASHEET_TFLOPS
    if a.steps < 1 or a.warmup < 0 or a.profile_steps < 0 or a.nproc < 1 or min(a.budget_s, a.job_timeout_s) <= 0:
        p.error("--steps and --nproc must be >= 1, --warmup and --profile-steps >= 0, --budget-s and "
                "--job-timeout-s > 0")
    a.device_memory_gib = None
    if a.peak_json:
        try:
            with open(a.peak_json, encoding="utf-8") as f:
                peak = json.load(f)
            a.peak_tflops = a.peak_tflops or float(peak["median_tflops"])
            a.device_memory_gib = peak.get("machine", {}).get("device_memory_gib")
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--peak-json {a.peak_json}: no median_tflops there ({e})")
    return a


def make_spec(a: argparse.Namespace) -> BenchSpec:
    from megatron.training.config import padded_vocab_size

    layers, hidden, heads, vocab, seq, micro = PRESETS[a.preset]
    micro = a.micro_batch or micro
    return BenchSpec(layers=layers, hidden=hidden, heads=heads, vocab=padded_vocab_size(vocab + 1, 128, 1),
                     seq=a.seq or seq, micro_batch=micro, global_batch=a.global_batch or micro * a.nproc,
                     steps=a.steps, warmup=a.warmup, lr=a.lr, weight_decay=0.1, clip_grad=1.0, seed=a.seed,
                     page_size=PAGE[a.preset], sub_group_size=100_000_000, threads=a.threads,
                     zero_keys={"stage3_prefetch_bucket_size": PAGE[a.preset],
                                "stage3_max_live_parameters": 3 * PAGE[a.preset],
                                "stage3_param_persistence_threshold": 10 * hidden},
                     mock_data_vocab=vocab, device=a.device, dtype=a.dtype, profile_steps=a.profile_steps)


def model_config(spec: BenchSpec):
    from megatron.core.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                             seq_length=spec.seq, padded_vocab_size=spec.vocab)


def trainer_argv(spec: BenchSpec, system: System, ds_path: str) -> list[str]:
    """pretrain_gpt.py flags for the spec's model, batches and optimizer (what the workers train)."""
    argv = ["--num-layers", str(spec.layers), "--hidden-size", str(spec.hidden),
            "--num-attention-heads", str(spec.heads), "--seq-length", str(spec.seq),
            "--max-position-embeddings", str(spec.seq), "--micro-batch-size", str(spec.micro_batch),
            "--global-batch-size", str(spec.global_batch), "--train-iters", str(spec.warmup + spec.steps),
            "--seed", str(spec.seed), "--lr", str(spec.lr), "--lr-decay-style", "constant",
            "--weight-decay", str(spec.weight_decay), "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]),
            "--adam-eps", str(EPS), "--clip-grad", str(spec.clip_grad),
            *mock_trainer_flags(spec.mock_data_vocab, spec.device)]
    if spec.dtype == "bf16":
        argv.append("--bf16")
    if system.impl == "zero_cache":
        argv += ["--deepspeed", "--deepspeed_config", ds_path]
    return argv


def run_worker(system: System, spec_path: str, a: argparse.Namespace, out_dir: str, timeout_s: float) -> JobResult:
    res = JobResult(system.key, system.name, log=os.path.join(out_dir, "log.txt"))
    cmd = worker_cmd(sys.executable, a.nproc, system.impl, system.key, spec_path, out_dir, system.offload)
    env = worker_env(a.threads)
    if a.device == "cuda":
        env["DS_ACCELERATOR"] = "cuda"  # worker_env's default is DeepSpeed's CPU accelerator
    rc, res.wall_s = run_job(cmd, res.log, timeout_s, env)
    files = [os.path.join(out_dir, f"result_rank{r}.json") for r in range(a.nproc)]
    if all(os.path.isfile(f) for f in files):
        res.status = "ok"  # every rank wrote its results after its last step
        if rc:
            res.error = f"exit {rc} after the results were written: {first_error(out_dir, res.log, rc)}"
    else:  # cut short: the steps every rank finished, from the files they rewrite after each step
        res.status = "incomplete" if rc is None else "failed"
        res.error = cut_reason(timeout_s, res.wall_s) if rc is None else first_error(out_dir, res.log, rc)
        res.log_tail = log_tail(res.log)
        files = [os.path.join(out_dir, f"partial_rank{r}.json") for r in range(a.nproc)]
        if not all(os.path.isfile(f) for f in files):
            return res
    ranks = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            ranks.append(json.load(f))
    done = min(len(r["step_s"]) for r in ranks)
    res.step_s = [max(r["step_s"][i] for r in ranks) for i in range(done)]
    res.losses = ranks[0]["losses"][:done]
    res.peak_device_gib = max(r.get("peak_device_bytes", 0) for r in ranks) / 2**30
    res.peak_rss_gib = max(r["peak_rss"] for r in ranks) / 2**30
    res.overlap = ranks[0].get("overlap")
    return res


def run_trainer(system: System, spec: BenchSpec, a: argparse.Namespace, out_dir: str, timeout_s: float) -> JobResult:
    from tools.plot_run import LogParseError, parse_log, summary

    res = JobResult(system.key, system.name, log=os.path.join(out_dir, "log.txt"))
    ds_path = os.path.join(out_dir, "ds_config.json")
    with open(ds_path, "w", encoding="utf-8") as f:
        json.dump(spec.ds_config(a.nproc, system.offload), f, indent=1)
    cmd = [*torchrun(sys.executable, a.nproc), "pretrain_gpt.py", *trainer_argv(spec, system, ds_path)]
    rc, res.wall_s = run_job(cmd, res.log, timeout_s, dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
    try:
        run = parse_log(res.log)  # --log-interval 1: one line per iteration
        res.step_s, res.losses = run.step_time_s, run.lm_loss
        peaks = summary(run)["peak_memory_gib"]
        res.peak_device_gib, res.peak_rss_gib = peaks.get("cuda max alloc", 0.0), peaks.get("peak rss", 0.0)
    except LogParseError:
        pass
    if rc is None:
        res.status, res.error = "incomplete", f"{cut_reason(timeout_s, res.wall_s)} ({len(res.step_s)} iterations " \
                                              "logged)"
    elif rc or len(res.step_s) != spec.warmup + spec.steps:
        res.status, res.error = "failed", first_error(out_dir, res.log, rc or 1)
    else:
        res.status = "ok"
    if res.status != "ok":
        res.log_tail = log_tail(res.log)
    return res


def planned_step(spec: BenchSpec, a: argparse.Namespace, offload: bool) -> dict:
    """The planner's predicted step (ptm_planner/step_model.py) for our engine in the configuration the job runs
    (the spec's model, batches, page and sub-groups; host offload of every state, or none) with the measured matmul
    rate as the large-GEMM rate: {"step_s", "breakdown", "why"}; step_s None (and why) where it predicts none."""
    from ptm_planner.cli import request_from_args
    from ptm_planner.plan import Option, Planner

    argv = ["--num-layers", str(spec.layers), "--hidden-size", str(spec.hidden), "--num-attention-heads",
            str(spec.heads), "--seq-length", str(spec.seq), "--max-position-embeddings", str(spec.seq),
            "--vocab-size", str(spec.mock_data_vocab + 1), "--micro-batch-size", str(spec.micro_batch),
            "--gradient-accumulation-steps", str(spec.grad_accumulation(a.nproc)), "--nproc-per-node",
            str(a.nproc), "--device", a.device]
    if spec.dtype == "bf16":
        argv.append("--bf16")
    if a.device == "cuda":
        argv += ["--device-memory-gib", str(a.device_memory_gib or 80)]
        if a.peak_tflops:
            argv += ["--device-tflops", str(a.peak_tflops)]
    try:
        planner = Planner(request_from_args(argv)[0])
        # The job's own configuration (BenchSpec.ds_config): no sub-group kept on the device under offload.
        option = Option("cpu" if offload else "none", spec.page_size, spec.micro_batch, spec.recompute,
                        spec.sub_group_size, rate=0.0)
        step = planner.predict(planner.evaluate(option))
    except Exception as e:  # the prediction is a column of the table, never the reason a run fails
        return {"step_s": None, "breakdown": None, "why": f"planner: {type(e).__name__}: {e}".splitlines()[0][:200]}
    if step is None:
        return {"step_s": None, "breakdown": None, "why": "the planner predicts accelerator steps only"}
    why = "" if a.peak_tflops else "at the h100 profile's GEMM rate (no measured peak)"
    return {"step_s": step.step_s, "breakdown": step.lines(), "why": why}


# ---- figures ------------------------------------------------------------------------------------------------
def median_step(res: JobResult, warmup: int) -> float | None:
    """Median of the timed steps done (all of them, or those before a job was cut short)."""
    timed = res.step_s[warmup:]
    return statistics.median(timed) if timed else None


def loss_diff(losses: list[float], ref: list[float]) -> float | None:
    """Largest relative difference over the steps both ran."""
    n = min(len(losses), len(ref))
    return max(abs(x - y) / abs(y) for x, y in zip(losses[:n], ref[:n])) if n else None


def figures(results: list[JobResult], spec: BenchSpec, a: argparse.Namespace, reference: tuple[str, list[float]],
            planned: dict[bool, dict]) -> dict[str, dict]:
    fpt = model_config(spec).flops_per_token()
    out = {}
    for r in results:
        step = median_step(r, spec.warmup)
        if step is None:
            continue
        tokens = spec.global_batch * spec.seq / step
        tflops = tokens * fpt / a.nproc / 1e12
        predicted = planned.get(SYSTEMS[r.key].offload, {}).get("step_s")
        f = {"median_step_s": step, "first_step_s": r.step_s[0], "timed_steps": len(r.step_s) - spec.warmup,
             "complete": r.status == "ok", "tokens_per_s": tokens, "tflops": tflops, "predicted_step_s": predicted,
             "predicted_over_measured": predicted / step if predicted else None,
             "mfu": tflops / a.peak_tflops if a.peak_tflops else None,
             "mfu_datasheet": tflops / a.datasheet_tflops if a.datasheet_tflops else None,
             "last_loss": r.losses[-1] if r.losses else None}
        if reference[1] and r.key != reference[0]:
            f["loss_diff"] = loss_diff(r.losses, reference[1])
        out[r.key] = f
    return out


def ratios(figs: dict[str, dict]) -> list[dict]:
    """tokens/s of each of our rows over each peer's with the same offload."""
    out = []
    for ours, f in figs.items():
        if not ours.startswith("ours") or not f["complete"]:
            continue
        offload = SYSTEMS[ours].offload
        for peer in PEERS:
            key = f"{peer}-offload" if offload else peer
            if key in figs and figs[key]["complete"]:
                out.append({"ours": ours, "peer": key, "ratio": f["tokens_per_s"] / figs[key]["tokens_per_s"]})
    return out


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def steps_done(r: JobResult) -> str:
    """An incomplete job's figures so far: its steps and their times."""
    if not r.step_s:
        return "no step done"
    return f"{len(r.step_s)} step(s) done: {', '.join(f'{x:.2f}' for x in r.step_s[:8])} s"


def predicted_cell(f: dict, planned: dict) -> str:
    if f.get("predicted_step_s") is None:
        return f"- ({planned.get('why') or 'no prediction'})"
    return f"{f['predicted_step_s']:.3f} / {f['median_step_s']:.3f} = {f['predicted_over_measured']:.2f}"


def table(results: list[JobResult], figs: dict[str, dict], a: argparse.Namespace, reference: str,
          planned: dict[bool, dict]) -> list[str]:
    peak = f"{a.peak_tflops:.3g} measured" if a.peak_tflops else "no peak given"
    sheet = f"{a.datasheet_tflops:g} datasheet" if a.datasheet_tflops else "no datasheet"
    lines = [f"| system | tokens/s | TFLOP/s | MFU ({peak}) | MFU ({sheet}) | median step (s) | first step (s) "
             f"| job (s) | fixed (s) | peak GPU (GiB) | peak RSS (GiB) | last loss | max loss diff vs "
             f"{reference or '-'} | copy time hidden (profiler) | planner predicted / measured (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in results:
        f = figs.get(r.key)
        if f is None:
            why = f"{r.status}: {r.error}" if r.error else r.status
            if r.status == "incomplete":
                why += f"; {steps_done(r)}"
            lines.append(f"| {r.name} | {why.replace('|', '/')[:300]} | | | | | | | | | | | | | |")
            continue
        diff = f.get("loss_diff")
        check = "reference" if r.key == reference else "-" if diff is None else \
            f"{diff:.1e} {'ok' if diff <= a.loss_rtol else '**MISMATCH**'}"
        hidden = f"{100 * r.overlap['hidden']:.0f}% of {r.overlap['copy_seconds'] * 1e3:.0f} ms" \
            if r.overlap and r.overlap.get("copies") else "-"
        name = r.name if f["complete"] else f"{r.name} ({r.status} after {f['timed_steps']} timed steps: {r.error})"
        name = name.replace("|", "/")
        lines.append(f"| {name} | {f['tokens_per_s']:,.0f} | {f['tflops']:.1f} | {_num(f['mfu'], '.1%')} "
                     f"| {_num(f['mfu_datasheet'], '.1%')} | {f['median_step_s']:.3f} | {f['first_step_s']:.2f} "
                     f"| {r.wall_s:.0f} | {r.fixed_s:.0f} | {_num(r.peak_device_gib or None, '.1f')} "
                     f"| {r.peak_rss_gib:.1f} | {_num(f['last_loss'], '.4f')} | {check} | {hidden} "
                     f"| {predicted_cell(f, planned.get(SYSTEMS[r.key].offload, {}))} |")
    return lines


def conventions(a: argparse.Namespace) -> list[str]:
    """What the figures mean, under the table."""
    lines = ["MFU: model FLOPs per token = 6 x matmul parameters + 12 x layers x seq x hidden (attention, the causal "
             "mask's skipped half counted in full, as Megatron counts), x tokens/s, over the measured matmul peak "
             "(and the datasheet's). The planner's prediction counts 6 x parameters only, no attention.",
             "fixed (s): the job's wall time outside its steps (process start, torch import, rendezvous, model "
             "build, teardown)."]
    if a.nproc == 1:
        lines.append("One GPU: nothing is sharded, so the Megatron backend (plain data parallel, states all on the "
                     "GPU) is the real baseline; FSDP2 runs reshard_after_forward=False (re-gathering a one-rank "
                     "shard is a copy for nothing); ZeRO-3's machinery pays off with more ranks or offload.")
    return lines


def pick_reference(results: list[JobResult], a: argparse.Namespace) -> tuple[str, list[float]]:
    if a.reference_from:
        with open(a.reference_from, encoding="utf-8") as f:
            prev = json.load(f)
        key = prev.get("reference") or ""
        for r in prev.get("results", []):
            if r["key"] == key and r["status"] == "ok":
                return f"{key} (of {os.path.basename(a.reference_from)})", r["losses"]
        return "", []
    ok = {r.key: r for r in results if r.status == "ok"}
    for key in REFERENCES:
        if key in ok:
            return key, ok[key].losses
    return "", []


def report(results: list[JobResult], spec: BenchSpec, a: argparse.Namespace, header: str, started: str,
           planned: dict[bool, dict]) -> dict:
    ref_key, ref_losses = pick_reference(results, a)
    figs = figures(results, spec, a, (ref_key, ref_losses), planned)
    rows = table(results, figs, a, ref_key, planned)
    rat = ratios(figs)
    lines = rows + [""] + [f"{x['ours']} / {x['peer']}: {x['ratio']:.2f}x tokens/s" for x in rat]
    lines += [""] + conventions(a)
    return {"started": started, "header": header, "spec": dataclasses.asdict(spec), "device": a.device,
            "nproc": a.nproc, "planned": {("offload" if k else "none"): v for k, v in planned.items()},
            "conventions": conventions(a),
            "dtype": a.dtype, "peak_tflops": a.peak_tflops, "datasheet_tflops": a.datasheet_tflops,
            "flops_per_token": model_config(spec).flops_per_token(), "loss_rtol": a.loss_rtol, "reference": ref_key,
            "results": [{**dataclasses.asdict(r), "fixed_s": r.fixed_s} for r in results], "figures": figs,
            "ratios": rat, "table": lines}


def describe(spec: BenchSpec, a: argparse.Namespace) -> str:
    n = model_config(spec).num_parameters()
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return (f"GPT {size} params ({spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads, vocab "
            f"{spec.vocab}, tied), seq {spec.seq}, micro-batch {spec.micro_batch}, global batch {spec.global_batch}, "
            f"{a.nproc} rank(s) on {a.device}, {a.dtype}; {spec.warmup} warm-up + {spec.steps} timed steps"
            f"{f' + {spec.profile_steps} profiled' if spec.profile_steps else ''}; offload: host memory"
            f"{', pinned' if a.device == 'cuda' else ''}; AdamW lr {spec.lr} constant, wd "
            f"{spec.weight_decay}, clip {spec.clip_grad}; zero_cache page {spec.page_size:,} elements")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        spec = make_spec(a)
        spec.grad_accumulation(a.nproc)
        header = describe(spec, a)
    except ValueError as e:
        print(f"gpu_peers: error: {e}", file=sys.stderr)
        return 2
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    run_dir = a.run_dir or os.path.join(LOGS_DIR, f"gpu_peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(run_dir, exist_ok=True)
    spec_path = os.path.join(run_dir, "spec.json")
    spec.save(spec_path)
    print(f"{header}\nlogs: {run_dir}", flush=True)
    results = [JobResult(k, SYSTEMS[k].name) for k in a.systems]
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    for r in results:
        if SYSTEMS[r.key].impl == "deepspeed" and not has_deepspeed:
            r.status, r.error = "not installed", f"`import deepspeed` fails in {sys.executable}"

    planned = {off: planned_step(spec, a, off) for off in sorted({SYSTEMS[k].offload for k in a.systems})}

    def save() -> dict:
        out = report(results, spec, a, header, started, planned)
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
        return out

    deadline = time.monotonic() + a.budget_s
    raise_on_sigterm()
    todo = [r for r in results if r.status == "not run"]
    try:
        for r in todo:
            system = SYSTEMS[r.key]
            left = deadline - time.monotonic()
            timeout = min(a.job_timeout_s, left)
            if timeout < a.min_job_s:
                r.error = f"{left:.0f} s of --budget-s {a.budget_s:.0f} left"
                print(f"[{r.key}] not run: {r.error}", flush=True)
                continue
            out_dir = os.path.join(run_dir, r.key)
            fresh_job_dir(out_dir)
            print(f"[{r.key}] {system.name}: up to {timeout:.0f} s", flush=True)
            if system.kind == "trainer":
                done = run_trainer(system, spec, a, out_dir, timeout)
            else:
                done = run_worker(system, spec_path, a, out_dir, timeout)
            results[results.index(r)] = done
            state = "ok" if done.status == "ok" else f"{done.status}: {done.error}"
            print(f"[{r.key}] {state} ({done.wall_s:.0f} s wall)", flush=True)
            save()
            if terminated():  # the SIGTERM came during that job: it is recorded, nothing more starts
                raise Terminated()
    except Terminated:
        for r in results:
            if r.status == "not run" and not r.error:
                r.error = "stopped by SIGTERM (the stage's time limit)"
        out = save()
        print("gpu_peers: stopped by SIGTERM; results so far written", file=sys.stderr)
        print("\n".join(out["table"]), flush=True)
        return 124
    out = save()
    print(f"\n{header}\n\n" + "\n".join(out["table"]), flush=True)
    # A system left out for time, cut by its time (incomplete: its steps so far are in the table) or not installed
    # is not a failure; a job that failed is.
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
