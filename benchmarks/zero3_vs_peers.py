"""ZeRO-3 against its peers: ours (zero_cache), DeepSpeed ZeRO-3, PyTorch FSDP2 and DDP, on one GPT.

    source benchmarks/peers_env.sh                 # once: DeepSpeed in its own venv (benchmarks/.venv-peers)
    python benchmarks/zero3_vs_peers.py            # ~100M GPT, 2 ranks on gloo, fp32
    python benchmarks/zero3_vs_peers.py --preset tiny --systems ours deepspeed ddp

Every system is its own torchrun job (a fresh process per rank, so RSS is clean; a failure is reported in
its row and the rest still run) and trains the same GPTModel from the same seeded init on the same synthetic
batches with the same AdamW, clipping and batch sizes. The two ZeRO-3 engines get the same DeepSpeed JSON.
tokens/s is the global batch's tokens over the median step time of the timed steps (after the warm-up
steps); peak RSS is each rank's largest resident set over its whole job (psutil); the last-step loss of
every system must agree with DDP's to --loss-rtol (else the row is marked MISMATCH).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from peer_workers.harness import BenchSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_VENV_PYTHON = os.path.join(ROOT, "benchmarks", ".venv-peers", "bin", "python")
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
    system: System
    ranks: list[dict]  # result_rank{r}.json contents, rank order; empty on failure
    error: str | None
    wall_s: float
    load_end: float  # 1-minute load average when the job ended: other work on the machine (this job adds ~nproc)

    @property
    def step_s(self) -> list[float]:
        """Per step, the slowest rank's time (the ranks meet in the loss all-reduce every step)."""
        return [max(r["step_s"][i] for r in self.ranks) for i in range(len(self.ranks[0]["step_s"]))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m",
                   help="model size: tiny (2x256, vocab 8192) or 100m (12x768, vocab 32000; default)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--vocab", type=int, help="override the preset's (padded) vocabulary size")
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
    p.add_argument("--page-size", type=int, default=500_000_000,
                   help="zero_cache chunk size in elements (allgather_bucket_size; DeepSpeed ignores it in stage "
                        "3); default: DeepSpeed's and the engine's default 5e8")
    p.add_argument("--systems", nargs="+", choices=list(BY_KEY), default=list(BY_KEY), metavar="SYSTEM",
                   help=f"which rows to run, of: {' '.join(BY_KEY)} (default: all)")
    p.add_argument("--peers-python", default=os.environ.get("PEERS_PYTHON", PEERS_VENV_PYTHON),
                   help="python of the peers' venv (DeepSpeed); made by benchmarks/peers_env.sh")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per system before it is killed")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="allowed relative last-step loss difference")
    p.add_argument("--run-dir", help="logs and per-rank results (default: a new folder under /tmp)")
    p.add_argument("--json", help="also write every result to this JSON file")
    a = p.parse_args(argv)
    if a.global_batch % (a.micro_batch * a.nproc):
        p.error(f"--global-batch {a.global_batch} is not divisible by --micro-batch {a.micro_batch} x --nproc "
                f"{a.nproc}; choose sizes that divide")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return a


def make_spec(a: argparse.Namespace) -> BenchSpec:
    layers, hidden, heads, vocab = PRESETS[a.preset]
    return BenchSpec(layers=a.layers or layers, hidden=a.hidden or hidden, heads=a.heads or heads,
                     vocab=a.vocab or vocab, seq=a.seq, micro_batch=a.micro_batch, global_batch=a.global_batch,
                     steps=a.steps, warmup=a.warmup, lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
                     seed=a.seed, page_size=a.page_size, threads=a.threads)


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/ptm/torch_extensions"))  # cpu_adam build
    return env


def first_error(out_dir: str, log_path: str, rc: int) -> str:
    """The failing rank's exception (one line), else the log's last error-looking line, else the exit code."""
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("error_rank"):
            with open(os.path.join(out_dir, name), encoding="utf-8") as f:
                return f.readline().strip()
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if "Error" in ln or "error:" in ln]
    return lines[-1] if lines else f"exit code {rc}"


def run_system(system: System, spec_path: str, spec: BenchSpec, a: argparse.Namespace, run_dir: str) -> Outcome:
    out_dir = os.path.join(run_dir, system.key)
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "log.txt")
    python = a.peers_python if system.peers_env else sys.executable
    if not os.path.isfile(python):
        return Outcome(system, [], f"no python at {python}; run `source benchmarks/peers_env.sh` first", 0.0,
                       os.getloadavg()[0])
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           "-m", "benchmarks.peer_workers.worker", "--impl", system.impl, "--system", system.key,
           "--spec", spec_path, "--out-dir", out_dir] + (["--offload"] if system.offload else [])
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        # Own session: a timeout ends this job's whole process group (torchrun and its ranks), nothing else.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(spec.threads), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            os.killpg(proc.pid, signal.SIGKILL)

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
    if rc != 0 or not all(os.path.isfile(f) for f in files):
        return Outcome(system, [], first_error(out_dir, log_path, rc), wall, load)
    ranks = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            ranks.append(json.load(fh))
    return Outcome(system, ranks, None, wall, load)


def tokens_per_s(o: Outcome, spec: BenchSpec) -> float:
    return spec.global_batch * spec.seq / statistics.median(o.step_s[spec.warmup:])


def table(outcomes: list[Outcome], spec: BenchSpec, rtol: float) -> list[str]:
    ok = {o.system.key: o for o in outcomes if o.error is None}
    ref = ok.get("ddp") or next(iter(ok.values()), None)
    ref_loss = ref.ranks[0]["losses"][-1] if ref else None
    rows = ["| system | tokens/s | vs DeepSpeed ZeRO-3 (same offload) | median step (s) | peak RSS rank 0 / 1 (GiB) "
            f"| last-step loss | vs {ref.system.key if ref else '-'} loss | load at end |",
            "|---|---:|---:|---:|---:|---:|---|---:|"]
    for o in outcomes:
        if o.error is not None:
            rows.append(f"| {o.system.name} | failed: {o.error.replace('|', '/')} | | | | | | {o.load_end:.1f} |")
            continue
        tps = tokens_per_s(o, spec)
        peer = ok.get("deepspeed-offload" if o.system.offload else "deepspeed")
        ratio = f"{tps / tokens_per_s(peer, spec):.2f}x" if peer else "n/a (no DeepSpeed result)"
        rss = " / ".join(f"{r['peak_rss'] / 2**30:.2f}" for r in o.ranks)
        loss = o.ranks[0]["losses"][-1]
        rel = abs(loss - ref_loss) / abs(ref_loss)
        check = f"{rel:.1e} ok" if rel <= rtol else f"{rel:.1e} **MISMATCH** (> {rtol:g})"
        rows.append(f"| {o.system.name} | {tps:.1f} | {ratio} | {statistics.median(o.step_s[spec.warmup:]):.2f} "
                    f"| {rss} | {loss:.6f} | {check} | {o.load_end:.1f} |")
    return rows


def peers_versions(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('torch'), m.version('deepspeed'))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        torch_v, ds_v = out.stdout.split()
        return f"deepspeed {ds_v} (torch {torch_v} in its venv)"
    except (OSError, subprocess.SubprocessError, ValueError):
        return f"deepspeed: not found ({python})"


def header(spec: BenchSpec, a: argparse.Namespace) -> list[str]:
    from megatron.core.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                            seq_length=spec.seq, padded_vocab_size=spec.vocab)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return [
        f"GPT {cfg.num_parameters() / 1e6:.1f}M params ({spec.layers} layers, hidden {spec.hidden}, {spec.heads} "
        f"heads, vocab {spec.vocab}, tied embeddings), seq {spec.seq}, micro-batch {spec.micro_batch}, global batch "
        f"{spec.global_batch} ({a.nproc} ranks x {spec.micro_batch} x {spec.grad_accumulation(a.nproc)} accumulation)"
        f", fp32, gloo; {spec.warmup} warm-up + {spec.steps} timed steps; AdamW lr {spec.lr}, wd {spec.weight_decay}"
        f", clip {spec.clip_grad}; zero_cache page {spec.page_size:.3g} elements",
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {platform.node()}: {os.cpu_count()} cores, "
        f"{mem:.1f} GiB RAM, {spec.threads} thread(s)/rank, load average at start "
        f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}; {peers_versions(a.peers_python)}",
    ]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    spec = make_spec(a)
    run_dir = a.run_dir or os.path.join("/tmp", f"zero3_vs_peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(run_dir, exist_ok=True)
    spec_path = os.path.join(run_dir, "spec.json")
    spec.save(spec_path)
    lines = header(spec, a)
    print("\n".join(lines) + f"\nlogs: {run_dir}", flush=True)
    outcomes = []
    systems = [BY_KEY[k] for k in a.systems]
    for i, s in enumerate(systems):
        print(f"[{i + 1}/{len(systems)}] {s.name} ...", flush=True)
        o = run_system(s, spec_path, spec, a, run_dir)
        outcomes.append(o)
        state = f"failed: {o.error}" if o.error else f"{tokens_per_s(o, spec):.1f} tokens/s"
        print(f"[{i + 1}/{len(systems)}] {s.name}: {state} ({o.wall_s:.0f} s wall)", flush=True)
    rows = table(outcomes, spec, a.loss_rtol)
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(rows))
    print("\nlosses per step (global batch mean):")
    for o in outcomes:
        if o.error is None:
            print(f"  {o.system.key:<18} " + " ".join(f"{x:.6f}" for x in o.ranks[0]["losses"]))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"spec": dataclasses.asdict(spec), "header": lines, "table": rows,
                       "results": [{"system": o.system.key, "error": o.error, "wall_s": o.wall_s,
                                    "load_end": o.load_end, "ranks": o.ranks}
                                   for o in outcomes]}, f, indent=1)


if __name__ == "__main__":
    main()
