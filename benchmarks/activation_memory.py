"""Activation memory per rank of pretrain_gpt.py, measured against what the planner plans (ptm_planner/activations.py).

    python -m benchmarks.activation_memory                                  # 1K..4K, every configuration
    python -m benchmarks.activation_memory --seqs 2048 --configs none,full  # a subset
    python -m benchmarks.activation_memory --seqs 2048 --vocab 1024 --layers 4 [--llama]  # the layers' share

Each run is its own process (one rank, or torchrun for two) training a ~100M-class GPT shape (hidden 768, 12
heads, ffn 3072, vocab 32000; 2 layers by default so that 4K tokens take well under a minute on 2 cores) for
two steps on --mock-data, fp32 on CPU, attention dropout 0 (torch's flash-style CPU kernel; context
parallelism needs it), hidden dropout 0.1. A rank measures the forward and backward of its second step:
VmHWM reset (``echo 5 > /proc/self/clear_refs``) before, peak RSS minus the RSS before it, so only what the
step allocated counts (parameters, gradient buffers and Adam states exist already; the optimizer's own step is
outside). glibc is told to map every block of 128 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so freed
activations leave RSS instead of staying in a heap the next step reuses without being counted. The wrapper
replaces ``megatron.training.training.forward_backward`` in the worker process only, for measurement; nothing of
the trainer is edited.

Planned: ``activation_memory(...)`` for the same shape and flags, device and host bytes (on a CPU both are RAM).
Korthikanti: Korthikanti et al. 2022 per layer (non_state.layer_activation_bytes) and the loss's logits, for
comparison. A configuration whose flags pretrain_gpt.py rejects (parse_args: not there yet, or refused) is
skipped with the trainer's reason, so the script can be rerun as the flags land.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MMAP_THRESHOLD = 128 << 10


@dataclass(frozen=True)
class Configuration:
    name: str
    nproc: int
    flags: tuple[str, ...]  # trainer flags beyond the model's
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_comm_type: str = "p2p"
    recompute: str | None = None
    offloaded_layers: int = 0


CONFIGURATIONS = {c.name: c for c in (
    Configuration("none", 1, ()),
    Configuration("full", 1, ("--recompute-granularity", "full"), recompute="full"),
    Configuration("selective", 1, ("--recompute-granularity", "selective"), recompute="selective"),
    Configuration("tp2", 2, ("--tensor-model-parallel-size", "2"), tp=2),
    Configuration("tp2-sp", 2, ("--tensor-model-parallel-size", "2", "--sequence-parallel"), tp=2,
                  sequence_parallel=True),
    Configuration("cp2", 2, ("--context-parallel-size", "2"), cp=2),
    Configuration("cp2-a2a", 2, ("--context-parallel-size", "2", "--cp-comm-type", "a2a"), cp=2,
                  cp_comm_type="a2a"),
    Configuration("cp2-allgather", 2, ("--context-parallel-size", "2", "--cp-comm-type", "allgather"), cp=2,
                  cp_comm_type="allgather"),
    Configuration("cp2-offload", 2, ("--context-parallel-size", "2", "--cpu-offloading",
                                     "--cpu-offloading-num-layers", "1"), cp=2, offloaded_layers=1),
    Configuration("cp2-selective", 2, ("--context-parallel-size", "2", "--recompute-granularity", "selective"),
                  cp=2, recompute="selective"),
    Configuration("cp2-full", 2, ("--context-parallel-size", "2", "--recompute-granularity", "full"), cp=2,
                  recompute="full"),
)}


# Llama's layer (--llama): rotary positions, RMSNorm, SwiGLU of 8/3 h, no biases, 4 query groups.
LLAMA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--num-query-groups", "4")


def ffn(a: argparse.Namespace) -> int:
    return 8 * a.hidden // 3 if a.llama else 4 * a.hidden


def trainer_argv(a: argparse.Namespace, seq: int, conf: Configuration) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--ffn-hidden-size", str(ffn(a)), "--seq-length", str(seq), "--max-position-embeddings",
            str(seq), "--micro-batch-size", str(a.mbs), "--train-iters", "2", "--lr", "1e-4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab - 1), "--attention-dropout", "0",
            "--hidden-dropout", "0.1", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--distributed-backend", "gloo", "--seed", "1234", *(LLAMA if a.llama else ()), *conf.flags]


# ---- the worker: one rank of pretrain_gpt.py with its forward and backward measured ---------------------
def _status_kib() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields


def worker(out_dir: str, argv: list[str]) -> None:
    import megatron.training.training as training
    from pretrain_gpt import main

    steps: list[dict[str, int]] = []
    original = training.forward_backward

    def measured(*args, **kwargs):
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status_kib()["VmRSS"]
        try:
            return original(*args, **kwargs)
        finally:
            steps.append({"before_kib": before, "peak_kib": _status_kib()["VmHWM"]})

    training.forward_backward = measured
    try:
        main(argv)
    finally:
        training.forward_backward = original
    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(steps))


# ---- the parent: runs, plans, table ---------------------------------------------------------------------
def rejected(argv: list[str], nproc: int) -> str | None:
    """Why pretrain_gpt.py refuses these flags on ``nproc`` ranks (its one line), or None."""
    import contextlib
    import io

    from megatron.training.arguments import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(argv, world_size=nproc)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    except ValueError as e:  # ConfigError: one line naming the flag
        return str(e)
    return None


def measure(a: argparse.Namespace, argv: list[str], nproc: int) -> tuple[int | None, str]:
    """Peak activation bytes of the second step, the largest of the ranks (None and the error on failure)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": str(a.threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="activation_memory.") as out:
        me = [str(ROOT / "benchmarks" / "activation_memory.py"), "--worker", out, "--"]
        if nproc == 1:
            cmd = [sys.executable, *me, *argv]
        else:  # a venv over a machine's torch has no bin/torchrun
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   *me, *argv]
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
        files = sorted(Path(out).glob("rank*.json"))
        if run.returncode or len(files) != nproc:
            lines = (run.stderr or run.stdout).strip().splitlines()
            return None, lines[-1] if lines else f"exit {run.returncode}"
        peaks = []
        for path in files:
            steps = json.loads(path.read_text())
            step = steps[min(1, len(steps) - 1)]
            peaks.append((step["peak_kib"] - step["before_kib"]) * 1024)
        return max(peaks), ""


def planned(a: argparse.Namespace, seq: int, conf: Configuration) -> tuple[int, int]:
    """(planned device + host bytes, Korthikanti et al.'s estimate) of the rank with the most."""
    from megatron.core.transformer_config import TransformerConfig
    from megatron.training.config import padded_vocab_size
    from ptm_planner.activations import ActivationSetup, activation_memory, logits_bytes
    from ptm_planner.non_state import layer_activation_bytes

    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 num_query_groups=4) if a.llama else {}
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            ffn_hidden_size=ffn(a), seq_length=seq,
                            padded_vocab_size=padded_vocab_size(a.vocab, 128, conf.tp), attention_dropout=0.0,
                            hidden_dropout=0.1, **llama)
    setup = ActivationSetup(seq_length=seq, micro_batch=a.mbs, tp=conf.tp, sequence_parallel=conf.sequence_parallel,
                            cp=conf.cp, cp_comm_type=conf.cp_comm_type, recompute=conf.recompute,
                            offloaded_layers=conf.offloaded_layers, device="cpu")
    mem = activation_memory(cfg, setup, a.layers)
    korthikanti = a.layers * layer_activation_bytes(cfg, a.mbs, conf.tp) / conf.cp + logits_bytes(cfg, setup)
    return mem.device + mem.host, int(korthikanti)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="1024,2048,4096", help="sequence lengths, comma-separated")
    p.add_argument("--configs", default=",".join(CONFIGURATIONS), help=f"of {', '.join(CONFIGURATIONS)}")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000, help="padded vocabulary (NullTokenizer ids + eod)")
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--llama", action="store_true", help="Llama's layer: RoPE, RMSNorm, SwiGLU (8/3 h), no biases, "
                   "4 query groups")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="per rank")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = p.parse_args()
    seqs = [int(s) for s in a.seqs.split(",")]
    confs = [CONFIGURATIONS[c] for c in a.configs.split(",")]
    header = (f"GPT{' (Llama layer)' if a.llama else ''} {a.layers} layers, hidden {a.hidden}, {a.heads} heads, ffn "
              f"{ffn(a)}, vocab {a.vocab}, "
              f"micro-batch {a.mbs}, fp32 on CPU, attention dropout 0, hidden dropout 0.1; peak RSS of the second "
              f"step's forward and backward minus RSS before it, the largest rank")
    lines = [header, "", "| seq | configuration | measured GiB | planned GiB | planned / measured | Korthikanti GiB |",
             "|---:|---|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    skipped = []
    for conf in confs:
        for seq in seqs:
            argv = trainer_argv(a, seq, conf)
            reason = rejected(argv, conf.nproc)
            if reason is not None:
                skipped.append(f"skipped {conf.name} at seq {seq}: pretrain_gpt.py rejects its flags ({reason})")
                print(skipped[-1], flush=True)
                break  # the same flags at every length
            got, error = measure(a, argv, conf.nproc)
            if got is None:
                skipped.append(f"skipped {conf.name} at seq {seq}: the run failed ({error})")
                print(skipped[-1], flush=True)
                continue
            plan, korthikanti = planned(a, seq, conf)
            row = (f"| {seq} | {conf.name} | {got / 2**30:.3f} | {plan / 2**30:.3f} | {plan / got:.2f} | "
                   f"{korthikanti / 2**30:.3f} |")
            lines.append(row)
            print(row, flush=True)
    if a.out:
        Path(a.out).write_text("\n".join(lines + [""] + skipped) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(ROOT))
        worker(sys.argv[2], sys.argv[4:])
    else:
        main()
