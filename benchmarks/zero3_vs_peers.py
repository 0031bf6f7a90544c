"""ZeRO-3 against its peers: ours (zero_cache), DeepSpeed ZeRO-3, PyTorch FSDP2 and DDP, on one GPT.

    source benchmarks/peers_env.sh                 # once: DeepSpeed in its own venv (benchmarks/.venv-peers)
    python -m benchmarks.zero3_vs_peers            # ~100M GPT, 2 ranks on gloo, fp32
    python -m benchmarks.zero3_vs_peers --preset tiny --systems ours deepspeed ddp

Every system is its own torchrun job (a fresh process per rank, so RSS is clean; a failure is reported in
its row and the rest still run) and trains the same GPTModel from the same seeded init on the same synthetic
batches with the same AdamW, clipping and batch sizes. The two ZeRO-3 engines get the same DeepSpeed JSON.
tokens/s is the global batch's tokens over the median step time of the timed steps (after the warm-up
steps); peak RSS is each rank's largest resident set over its whole job (psutil); the last-step loss of
every system must agree with DDP's to --loss-rtol (else the row is marked MISMATCH). The machine may be
shared: the table shows the load average after each job, and --repeat N runs all systems N times
round-robin and pools each system's timed steps. The report (header, table, notes, losses) is printed and
written to --table (default benchmarks/results/zero3_vs_peers.md); the jobs' logs and per-rank results go to
--run-dir (default a new folder under benchmarks/logs/, which git ignores).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from benchmarks.peer_workers.harness import (
    LOGS_DIR,
    PEERS_PYTHON,
    RESULTS_DIR,
    ROOT,
    BenchSpec,
    first_error,
    fresh_job_dir,
    kill_tree,
    worker_cmd,
    worker_env,
)

PRESETS = {  # layers, hidden, heads, vocab
    "tiny": (2, 256, 4, 8192),
    "100m": (12, 768, 12, 32000),
}


@dataclass(frozen=True)
class System:
    key: str  # --systems name
    name: str  # table row
    impl: str  # peer_workers.worker --impl
    offload: bool
    peers_env: bool  # needs the peers' venv (DeepSpeed)


# Compared pairs run back to back, so they see similar load from other work on the machine.
SYSTEMS = [
    System("ours", "ours: zero_cache ZeRO-3", "ours", False, False),
    System("deepspeed", "DeepSpeed ZeRO-3", "deepspeed", False, True),
    System("ours-offload", "ours: zero_cache ZeRO-3 + CPU offload", "ours", True, False),
    System("deepspeed-offload", "DeepSpeed ZeRO-3 + CPU offload", "deepspeed", True, True),
    System("fsdp2", "FSDP2 (fully_shard)", "fsdp2", False, False),
    System("fsdp2-offload", "FSDP2 + CPUOffloadPolicy", "fsdp2", True, False),
    System("ddp", "DDP", "ddp", False, False),
]
BY_KEY = {s.key: s for s in SYSTEMS}


@dataclass
class Outcome:
    """One torchrun job: one system, one round."""
    system: System
    ranks: list[dict]  # result_rank{r}.json contents, rank order; empty on failure
    error: str | None
    wall_s: float
    load_end: float  # 1-minute load average when the job ended: other work on the machine (this job adds ~nproc)
    note: str | None = None  # something odd about a job that still produced its results

    def timed_step_s(self, warmup: int) -> list[float]:
        """Per timed step, the slowest rank's time (the ranks meet in the loss all-reduce every step)."""
        return [max(r["step_s"][i] for r in self.ranks) for i in range(warmup, len(self.ranks[0]["step_s"]))]


@dataclass
class Row:
    """A system's rounds, pooled: median over every timed step of every round, peak RSS over all rounds."""
    system: System
    rounds: list[Outcome]

    @property
    def error(self) -> str | None:
        failed = [(i, o) for i, o in enumerate(self.rounds) if o.error is not None]
        if not failed:
            return None
        i, o = failed[0]
        return o.error if len(self.rounds) == 1 else f"round {i + 1}: {o.error}"

    def median_step_s(self, warmup: int) -> float:
        return statistics.median(t for o in self.rounds for t in o.timed_step_s(warmup))

    def first_step_s(self) -> float:
        """The first (warm-up) step, median over rounds: one-time costs such as a ZeRO-3 trace recording."""
        return statistics.median(max(r["step_s"][0] for r in o.ranks) for o in self.rounds)

    def peak_rss(self) -> list[int]:
        return [max(o.ranks[r]["peak_rss"] for o in self.rounds) for r in range(len(self.rounds[0].ranks))]

    @property
    def losses(self) -> list[float]:
        return self.rounds[0].ranks[0]["losses"]

    def rounds_agree(self, rtol: float) -> bool:
        last = self.losses[-1]
        return all(abs(o.ranks[0]["losses"][-1] - last) <= rtol * abs(last) for o in self.rounds)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The batch, step, rank and optimizer flags of the peer benchmarks (this one and moe_vs_peers)."""
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8, help="micro-batch x ranks x accumulation steps")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--nproc", type=int, default=2, help="ranks (gloo, one machine)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2),
                   help="intra-op threads per rank (default: cores / 2)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)


def add_report_args(p: argparse.ArgumentParser, systems: list[str], table: str) -> None:
    """Which systems, how many rounds, where the peers' python is and where the report goes."""
    p.add_argument("--systems", nargs="+", choices=systems, default=systems, metavar="SYSTEM",
                   help=f"which rows to run, of: {' '.join(systems)} (default: all)")
    p.add_argument("--peers-python", default=os.environ.get("PEERS_PYTHON", PEERS_PYTHON),
                   help="python of the peers' venv (DeepSpeed); made by benchmarks/peers_env.sh")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over all systems (pooled per system): evens out load from other work on the machine")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job before it is killed")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="allowed relative loss difference from the reference")
    p.add_argument("--run-dir", help="logs and per-rank results (default: a new folder under benchmarks/logs/)")
    p.add_argument("--table", default=os.path.join(RESULTS_DIR, table),
                   help="markdown file the printed report is also written to ('' for none; default: %(default)s)")
    p.add_argument("--json", help="also write every result to this JSON file")


def check_run_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.global_batch % (a.micro_batch * a.nproc):
        p.error(f"--global-batch {a.global_batch} is not divisible by --micro-batch {a.micro_batch} x --nproc "
                f"{a.nproc}; choose sizes that divide")
    if a.steps < 1 or a.warmup < 0 or a.repeat < 1:
        p.error("--steps and --repeat must be >= 1 and --warmup >= 0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m",
                   help="model size: tiny (2x256, vocab 8192) or 100m (12x768, vocab 32000; default)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--vocab", type=int, help="override the preset's (padded) vocabulary size")
    add_run_args(p)
    p.add_argument("--page-size", type=int, default=500_000_000,
                   help="zero_cache chunk size in elements (allgather_bucket_size; DeepSpeed ignores it in stage "
                        "3); default: DeepSpeed's and the engine's default 5e8")
    add_report_args(p, list(BY_KEY), "zero3_vs_peers.md")
    a = p.parse_args(argv)
    check_run_args(p, a)
    return a


def make_spec(a: argparse.Namespace) -> BenchSpec:
    layers, hidden, heads, vocab = PRESETS[a.preset]
    return BenchSpec(layers=a.layers or layers, hidden=a.hidden or hidden, heads=a.heads or heads,
                     vocab=a.vocab or vocab, seq=a.seq, micro_batch=a.micro_batch, global_batch=a.global_batch,
                     steps=a.steps, warmup=a.warmup, lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
                     seed=a.seed, page_size=a.page_size, threads=a.threads)


def run_system(system: System, spec_path: str, spec: BenchSpec, a: argparse.Namespace, run_dir: str,
               round_index: int) -> Outcome:
    out_dir = os.path.join(run_dir, system.key if a.repeat == 1 else f"{system.key}-round{round_index + 1}")
    fresh_job_dir(out_dir)
    log_path = os.path.join(out_dir, "log.txt")
    python = a.peers_python if system.peers_env else sys.executable
    if not os.path.isfile(python):
        return Outcome(system, [], f"no python at {python}; run `source benchmarks/peers_env.sh` first", 0.0,
                       os.getloadavg()[0])
    cmd = worker_cmd(python, a.nproc, system.impl, system.key, spec_path, out_dir, system.offload)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        # Own session; a timeout ends the job's whole process tree (torchrun starts each rank in a session of its
        # own, so its process group is not enough).
        proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(spec.threads), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            kill_tree(proc.pid)

        timer = threading.Timer(a.timeout, kill)
        timer.start()
        for line in proc.stdout:
            log.write(line)
            if line.startswith(f"[{system.key}] step"):
                print("   " + line.rstrip(), flush=True)
        rc = proc.wait()
        timer.cancel()
    wall, load = time.perf_counter() - start, os.getloadavg()[0]
    if timed_out.is_set():
        return Outcome(system, [], f"timed out after {a.timeout:.0f} s (log: {log_path})", wall, load)
    files = [os.path.join(out_dir, f"result_rank{r}.json") for r in range(a.nproc)]
    if not all(os.path.isfile(f) for f in files):
        return Outcome(system, [], first_error(out_dir, log_path, rc), wall, load)
    ranks = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            ranks.append(json.load(fh))
    # Results are written after the last step and a barrier: a non-zero exit after that is a teardown crash.
    note = None if rc == 0 else \
        f"{first_error(out_dir, log_path, rc)}, after every rank had written its results (log: {log_path})"
    return Outcome(system, ranks, None, wall, load, note)


def tokens_per_s(median_step_s: float, spec: BenchSpec) -> float:
    return spec.global_batch * spec.seq / median_step_s


def table(rows: list[Row], spec: BenchSpec, rtol: float) -> list[str]:
    ok = {r.system.key: r for r in rows if r.error is None}
    ref = ok.get("ddp") or next(iter(ok.values()), None)
    out = ["| system | tokens/s | vs DeepSpeed ZeRO-3 (same offload) | median step (s) | first step (s) "
           f"| peak RSS rank 0 / 1 (GiB) | last-step loss | vs {ref.system.key if ref else '-'} loss | load at end |",
           "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        load = " / ".join(f"{o.load_end:.1f}" for o in r.rounds)
        if r.error is not None:
            out.append(f"| {r.system.name} | failed: {r.error.replace('|', '/')} | | | | | | | {load} |")
            continue
        step = r.median_step_s(spec.warmup)
        peer = ok.get("deepspeed-offload" if r.system.offload else "deepspeed")
        ratio = f"{peer.median_step_s(spec.warmup) / step:.2f}x" if peer else "n/a (no DeepSpeed result)"
        rss = " / ".join(f"{b / 2**30:.2f}" for b in r.peak_rss())
        loss, ref_loss = r.losses[-1], ref.losses[-1]
        rel = abs(loss - ref_loss) / abs(ref_loss)
        check = f"{rel:.1e} ok" if rel <= rtol else f"{rel:.1e} **MISMATCH** (> {rtol:g})"
        if not r.rounds_agree(rtol):
            check += " **rounds disagree**"
        out.append(f"| {r.system.name} | {tokens_per_s(step, spec):.1f} | {ratio} | {step:.2f} "
                   f"| {r.first_step_s():.2f} | {rss} | {loss:.6f} | {check} | {load} |")
    return out


def peers_versions(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('torch'), m.version('deepspeed'))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        torch_v, ds_v = out.stdout.split()
        return f"deepspeed {ds_v} (torch {torch_v} in its venv)"
    except (OSError, subprocess.SubprocessError, ValueError):
        return f"deepspeed: not found ({python})"


def machine_line(threads: int, peers_python: str) -> str:
    """The report's line on when and where it ran: date, host, cores, RAM, threads per rank, load, versions."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {platform.node()}: {os.cpu_count()} cores, "
            f"{mem:.1f} GiB RAM, {threads} thread(s)/rank, load average at start {os.getloadavg()[0]:.1f}; torch "
            f"{torch.__version__}; {peers_versions(peers_python)}")


def header(spec: BenchSpec, a: argparse.Namespace) -> list[str]:
    from megatron.core.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                            seq_length=spec.seq, padded_vocab_size=spec.vocab)
    return [
        f"GPT {cfg.num_parameters() / 1e6:.1f}M params ({spec.layers} layers, hidden {spec.hidden}, {spec.heads} "
        f"heads, vocab {spec.vocab}, tied embeddings), seq {spec.seq}, micro-batch {spec.micro_batch}, global batch "
        f"{spec.global_batch} ({a.nproc} ranks x {spec.micro_batch} x {spec.grad_accumulation(a.nproc)} accumulation)"
        f", fp32, gloo; {spec.warmup} warm-up + {spec.steps} timed steps; AdamW lr {spec.lr}, wd {spec.weight_decay}"
        f", clip {spec.clip_grad}; zero_cache page {spec.page_size:.3g} elements; {a.repeat} round(s)",
        machine_line(spec.threads, a.peers_python),
    ]


def write_table(path: str, argv: list[str] | None, lines: list[str], out: list[str], notes: list[str],
                losses: list[str], *, script: str = "zero3_vs_peers",
                steps_title: str = "Losses per step (global batch mean, round 1):") -> None:
    """The printed report as markdown: the command, the header, the table, the notes and the per-step lines."""
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text = [f"    python -m benchmarks.{script} {command}".rstrip(), "", "```", *lines, "```", "", *out]
    if notes:
        text += ["", "notes:", "", "```", *notes, "```"]
    text += ["", steps_title, "", "```", *losses, "```"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(text) + "\n")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    spec = make_spec(a)
    try:
        lines = header(spec, a)
    except ValueError as e:  # a model shape the GPT cannot take, caught before any job starts
        raise SystemExit(f"zero3_vs_peers.py: error: {e}") from None
    run_dir = a.run_dir or os.path.join(LOGS_DIR, f"zero3_vs_peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(run_dir, exist_ok=True)
    spec_path = os.path.join(run_dir, "spec.json")
    spec.save(spec_path)
    print("\n".join(lines) + f"\nlogs: {run_dir}", flush=True)
    rows = [Row(BY_KEY[k], []) for k in a.systems]
    jobs, started = len(rows) * a.repeat, time.perf_counter()
    for n in range(jobs):
        row, round_index = rows[n % len(rows)], n // len(rows)
        tag = f"[{n + 1}/{jobs}]" + (f" round {round_index + 1}" if a.repeat > 1 else "")
        print(f"{tag} {row.system.name} ...", flush=True)
        o = run_system(row.system, spec_path, spec, a, run_dir, round_index)
        row.rounds.append(o)
        state = f"failed: {o.error}" if o.error else \
            f"{tokens_per_s(statistics.median(o.timed_step_s(spec.warmup)), spec):.1f} tokens/s"
        elapsed = time.perf_counter() - started
        print(f"{tag} {row.system.name}: {state} ({o.wall_s:.0f} s wall; ETA of the run "
              f"{elapsed / (n + 1) * (jobs - n - 1):.0f} s)", flush=True)
    out = table(rows, spec, a.loss_rtol)
    notes = [f"  {r.system.key} round {i + 1}: {o.note}" for r in rows for i, o in enumerate(r.rounds) if o.note]
    losses = [f"  {r.system.key:<18} " + " ".join(f"{x:.6f}" for x in r.losses) for r in rows if r.error is None]
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(out))
    if notes:
        print("\nnotes:\n" + "\n".join(notes))
    print("\nlosses per step (global batch mean, round 1):\n" + "\n".join(losses))
    if a.table:
        write_table(a.table, argv, lines, out, notes, losses)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"spec": dataclasses.asdict(spec), "header": lines, "table": out,
                       "results": [{"system": r.system.key, "round": i + 1, "error": o.error, "note": o.note,
                                    "wall_s": o.wall_s, "load_end": o.load_end, "ranks": o.ranks}
                                   for r in rows for i, o in enumerate(r.rounds)]}, f, indent=1)


if __name__ == "__main__":
    main()
