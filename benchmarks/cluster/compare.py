"""Our ZeRO-3 and Megatron DDP on emulated clusters: s/step and the bytes per step on the links (as root).

    python -m benchmarks.cluster.compare --topologies 2x2,4x2 --profiles h100,a100-eth --out results.md

For each topology (hosts x ranks per host): this machine's matmul rate per rank is measured with all ranks
at once, the hosts come up, and for each profile the links are shaped from it and each strategy trains the
same tiny GPT (``pretrain_gpt.py`` on mock data, gloo): ``zero3`` is the trainer with ``--deepspeed`` and
examples/ds_config_zero3.json made to fit the tiny model (chunks of BUCKET elements, nothing kept whole,
collectives recorded), ``ddp`` the trainer without it. Per job: the trainer's median s/step and the kernel's
inter-host and intra-host bytes per step (medians of the steps after the first), next to the engine's own
count of the bytes in the logging rank's collectives (ZeRO only). Prints a markdown table; ``--out`` writes it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cluster.hosts import REPO
from benchmarks.cluster.job import run_job, summarize
from benchmarks.cluster.run import MIB, cluster_choice, exits_on_cluster_failure, shaped_clusters, stop_on_sigterm

BUCKET = 16_384  # elements per ZeRO chunk: several chunks per layer of the tiny GPT, so gathers overlap compute


def gpt_args(world: int, hidden: int, layers: int, seq: int, micro_batch: int, steps: int) -> list[str]:
    return ["pretrain_gpt.py", "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", "2", "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", str(micro_batch), "--global-batch-size", str(micro_batch * world),
            "--train-iters", str(steps), "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--distributed-backend", "gloo", "--log-interval", "1", "--seed", "1234",
            "--distributed-timeout-minutes", "15"]


def zero3_config(path: Path) -> Path:
    config = json.loads((REPO / "examples" / "ds_config_zero3.json").read_text())
    config["zero_optimization"].update(allgather_bucket_size=BUCKET, stage3_param_persistence_threshold=0,
                                       is_communication_time_profiling=True)
    config["steps_per_print"] = 1
    path.write_text(json.dumps(config, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--topologies", default="2x2,4x2", help="hosts x ranks per host, comma-separated")
    parser.add_argument("--profiles", default="h100,a100-eth")
    parser.add_argument("--strategies", default="zero3,ddp")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per job")
    parser.add_argument("--out", type=Path, help="write the markdown here")
    args = parser.parse_args(argv)
    topologies, profiles = cluster_choice(parser, args)
    strategies = args.strategies.split(",")
    if unknown := [s for s in strategies if s not in ("zero3", "ddp")]:
        parser.error(f"--strategies: unknown {unknown}; known: zero3, ddp")
    stop_on_sigterm()

    out = [f"Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; load before: "
           f"{_uptime()}", "",
           f"Command: `python -m benchmarks.cluster.compare {' '.join(argv if argv is not None else sys.argv[1:])}`",
           "", f"GPT: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch} "
           f"({args.seq * args.micro_batch} tokens per rank per step), vocab 128, fp32, gloo; {args.steps} steps, "
           "figures are medians of steps 2 on.", ""]
    derivations = []
    rows = ["| hosts x ranks | profile | strategy | s/step | inter-host MiB/step | intra-host MiB/step | "
            "engine MiB/step (logging rank) |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="ptm-cluster-compare-") as tmp:
        ds_config = zero3_config(Path(tmp) / "ds_config_zero3_tiny.json")
        with exits_on_cluster_failure("benchmarks.cluster.compare"):
            for hosts, ranks, name, spec in shaped_clusters(topologies, profiles, args.max_delay_ms, derivations):
                world = hosts * ranks
                for strategy in strategies:
                    argv_job = gpt_args(world, args.hidden, args.layers, args.seq, args.micro_batch,
                                        args.steps)
                    if strategy == "zero3":
                        argv_job += ["--deepspeed", "--deepspeed_config", str(ds_config)]
                    result = run_job(spec, argv_job, args.timeout_s)
                    summary = summarize(result)
                    if result.failure or summary is None:
                        print("\n".join(result.output[-30:]))
                        rows.append(f"| {hosts}x{ranks} | {name} | {strategy} | failed: "
                                    f"{(result.failure or 'no steps logged').splitlines()[0]} | | | |")
                    else:
                        engine = (f"{summary.engine_bytes / MIB:.2f}" if summary.engine_bytes is not None
                                  else "-")
                        rows.append(f"| {hosts}x{ranks} | {name} | {strategy} | {summary.seconds:.2f} | "
                                    f"{summary.inter_bytes / MIB:.2f} | {summary.intra_bytes / MIB:.2f} | "
                                    f"{engine} |")
                    print(rows[-1], flush=True)
    text = "\n".join([*out, *rows, "", "Derivations:", *derivations, "", f"Load after: {_uptime()}", ""])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
