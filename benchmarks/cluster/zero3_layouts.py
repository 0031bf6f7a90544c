"""Hierarchical ZeRO-3 layouts against their peers on emulated clusters: s/step, tokens/s, link bytes (as root).

    source benchmarks/peers_env.sh      # DeepSpeed's venv (PEERS_PYTHON)
    python -m benchmarks.cluster.zero3_layouts --topologies 2x2,4x2 --profiles h100,a100-eth --out results.md

For each topology (hosts x ranks per host) this machine's matmul rate per rank is measured with every rank
at once and the hosts come up once; for each profile the links are shaped from it (benchmarks/cluster/
profiles.py) and every system of the peer benchmark harness (benchmarks/peer_workers) trains the same tiny
GPT from the same seeded weights on the same mock batches (gloo, fp32) under torchrun on every host: our
engine flat and in each hierarchical layout (MiCS, hpZ, ZeRO++, MiCS + qwZ), DeepSpeed ZeRO-3 flat, ZeRO++ and
MiCS (in its own venv, on its CPU accelerator), FSDP2 full shard and HSDP, and DDP. Per job: the median s/step
and tokens/s of the timed steps, the kernel's inter-host and intra-host bytes per step, the final loss and the
largest relative loss difference from ours-flat over all steps. A job that fails has its row say why (the
failing rank's one-line error). Prints a markdown table; ``--out`` writes it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.cluster.job import JobResult, Summary, run_job, summarize
from benchmarks.cluster.run import MIB, cluster_choice, exits_on_cluster_failure, shaped_clusters, stop_on_sigterm
from benchmarks.peer_workers.harness import PEERS_PYTHON, BenchSpec, worker_env

# Every ZeRO-3 row: nothing kept whole, and a chunk released after its forward (reuse distance 0), so the
# backward gathers again as it must for a model larger than memory; otherwise the tiny model would stay
# gathered from forward to backward and hpZ would have no gather to keep inside the host.
BASE_ZERO_KEYS = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
QUANT_BLOCK = 256  # quantization_block_size's default: int8 values plus one fp32 scale per block


@dataclass(frozen=True)
class Variant:
    name: str  # the row
    impl: str  # benchmarks.peer_workers.worker --impl
    layout: str  # flat | mics | hpz | zero++ | mics+qw | hsdp | ddp
    reference: str  # the row whose inter-host bytes are this row's "flat"
    peers: bool = False  # runs with DeepSpeed's venv python


VARIANTS = [
    Variant("ours-flat", "ours", "flat", "ours-flat"),
    Variant("ours-mics", "ours", "mics", "ours-flat"),
    Variant("ours-hpz", "ours", "hpz", "ours-flat"),
    Variant("ours-zero++", "ours", "zero++", "ours-flat"),
    Variant("ours-mics+qw", "ours", "mics+qw", "ours-flat"),
    Variant("deepspeed-flat", "deepspeed", "flat", "deepspeed-flat", peers=True),
    Variant("deepspeed-zero++", "deepspeed", "zero++", "deepspeed-flat", peers=True),
    Variant("deepspeed-mics", "deepspeed", "mics", "deepspeed-flat", peers=True),
    Variant("fsdp2", "fsdp2", "flat", "fsdp2"),
    Variant("fsdp2-hsdp", "fsdp2", "hsdp", "fsdp2"),
    Variant("ddp", "ddp", "ddp", "ours-flat"),
]
BY_NAME = {v.name: v for v in VARIANTS}


def zero_keys(layout: str, ranks_per_host: int) -> dict:
    """The zero_optimization keys (DeepSpeed's names) of a layout, the hosts' blocks being ``ranks_per_host``."""
    hpz = {"zero_hpz_partition_size": ranks_per_host}
    mics = {"mics_shard_size": ranks_per_host}
    qw = {"zero_quantized_weights": True}
    extra = {"flat": {}, "mics": mics, "hpz": hpz, "zero++": {**hpz, **qw, "zero_quantized_gradients": True},
             "mics+qw": {**mics, **qw}, "hsdp": {}, "ddp": {}}[layout]
    return {**BASE_ZERO_KEYS, **extra}


def job_spec(base: BenchSpec, variant: Variant, ranks_per_host: int) -> BenchSpec:
    return replace(base, zero_keys=zero_keys(variant.layout, ranks_per_host),
                   hsdp_shard_size=ranks_per_host if variant.layout == "hsdp" else 0)


def inter_host_int8(layout: str) -> bool:
    """Whether the layout's inter-host collectives are int8 (else exact). ZeRO++: qwZ's first gather of a step
    and qgZ's all-to-all cross hosts in int8, and hpZ keeps the later gathers inside the host. MiCS + qwZ
    quantizes only its gathers, which stay inside the host; its gradients cross hosts exact."""
    return layout == "zero++"


def bf16_inter_bytes(measured: float, layout: str) -> float:
    """The inter-host bytes a bf16 run would move: our CPU runs send fp32 parameters and gradients, so an exact
    collective's bytes halve in bf16 and an int8 one's stay (the scalars beside them are negligible)."""
    return measured if inter_host_int8(layout) else measured / 2


def zeropp_expected_ratio(micro_batches: int = 1, block: int = QUANT_BLOCK, grad_bits: int = 4,
                          bf16: bool = True) -> float:
    """ZeRO++'s inter-host bytes over flat ZeRO-3's, per step of G micro-batches over P parameters on H hosts, with
    the engine's two-hop gloo collectives (each element crosses to each other host once):
    flat: a forward and a backward gather and a reduce-scatter per micro-batch, each (H - 1) P elements at e bytes
    (4 fp32, 2 bf16); ZeRO++: one int8 gather of (H - 1) P elements a step (hpZ serves the rest inside the host)
    at q_w = 1 + 4 / block bytes, and qgZ's all-to-all of (H - 1) P elements per micro-batch at
    q_g = grad_bits / 8 + 4 / block bytes. Ratio = (q_w + G q_g) / (3 G e): independent of P, H and R."""
    q_w, q_g = 1 + 4 / block, grad_bits / 8 + 4 / block
    e = 2 if bf16 else 4
    return (q_w + micro_batches * q_g) / (3 * micro_batches * e)


@dataclass
class Outcome:
    """One job: its summary and rank 0's losses (every step), or why it failed."""
    variant: Variant
    summary: Summary | None
    losses: list[float]
    error: str | None = None


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def table_rows(topology: str, profile: str, outcomes: list[Outcome], tokens_per_step: int) -> list[str]:
    """The markdown rows of one topology and profile: ratios against the rows named in them, "-" where that
    row failed or did not run."""
    ok = {o.variant.name: o for o in outcomes if o.error is None}

    def tps(name: str) -> float | None:
        return tokens_per_step / ok[name].summary.seconds if name in ok else None

    rows = []
    for o in outcomes:
        v = o.variant
        if o.error is not None:
            rows.append(f"| {topology} | {profile} | {v.name} | failed: {o.error} |" + " |" * 9)
            continue
        s = o.summary
        mine = tps(v.name)
        ratios = [f"{mine / ref:.2f}" if (ref := tps(name)) else "-" for name in ("deepspeed-flat", "ours-flat")]
        ref = ok.get(v.reference)
        inter_fp32 = inter_bf16 = "-"
        if ref is not None and ref.summary.inter_bytes > 0:
            inter_fp32 = f"{s.inter_bytes / ref.summary.inter_bytes:.3f}"
            bf16 = bf16_inter_bytes(s.inter_bytes, v.layout) / bf16_inter_bytes(ref.summary.inter_bytes,
                                                                                 ref.variant.layout)
            inter_bf16 = f"{bf16:.3f}"
        flat = ok.get("ours-flat")
        diff = f"{max_rel_diff(o.losses, flat.losses):.1e}" if flat is not None else "-"
        rows.append(f"| {topology} | {profile} | {v.name} | {s.seconds:.2f} | {mine:.0f} | {ratios[0]} | "
                    f"{ratios[1]} | {s.inter_bytes / MIB:.3f} | {s.intra_bytes / MIB:.3f} | {inter_fp32} | "
                    f"{inter_bf16} | {o.losses[-1]:.6f} | {diff} |")
    return rows


HEADER = ["| hosts x ranks | profile | system | s/step | tokens/s | vs deepspeed-flat | vs ours-flat | "
          "inter-host MiB/step | intra-host MiB/step | inter-host vs flat (fp32, measured) | "
          "inter-host vs flat (bf16-equivalent) | final loss | max rel. loss diff vs ours-flat |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def outcome(variant: Variant, result: JobResult, out_dir: Path, warmup: int) -> Outcome:
    """The job's summary and losses, or its failure in one line: the failing rank's own error line
    (error_rank*.txt, written by the worker) before the launcher's."""
    summary = summarize(result, skip=warmup)
    result_file = out_dir / "result_rank0.json"
    if result.failure is None and summary is not None and result_file.is_file():
        return Outcome(variant, summary, json.loads(result_file.read_text())["losses"])
    errors = sorted(out_dir.glob("error_rank*.txt"))
    if errors:
        reason = errors[0].read_text().splitlines()[0]
    else:
        reason = (result.failure or "no result_rank0.json and no step logged").splitlines()[0]
    return Outcome(variant, None, [], reason.replace("|", "/"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster.zero3_layouts",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--topologies", default="2x2,4x2", help="hosts x ranks per host, comma-separated")
    parser.add_argument("--profiles", default="h100,a100-eth")
    parser.add_argument("--systems", default=",".join(BY_NAME), help="rows to run, comma-separated")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accumulation", type=int, default=1, help="micro-batches per rank per step")
    parser.add_argument("--page-size", type=int, default=4096,
                        help="our chunk size in elements: several chunks per layer of the tiny GPT")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per job")
    parser.add_argument("--peers-python", default=os.environ.get("PEERS_PYTHON", PEERS_PYTHON),
                        help="DeepSpeed's venv python (benchmarks/peers_env.sh exports PEERS_PYTHON)")
    parser.add_argument("--out", type=Path, help="write the markdown here")
    args = parser.parse_args(argv)
    topologies, profiles = cluster_choice(parser, args)
    names = args.systems.split(",")
    if unknown := [n for n in names if n not in BY_NAME]:
        parser.error(f"--systems: unknown {unknown}; known: {', '.join(BY_NAME)}")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step carries start-up traffic)")
    variants = [BY_NAME[n] for n in names]
    if any(v.peers for v in variants) and not os.path.isfile(args.peers_python):
        parser.error(f"no python at {args.peers_python} for the DeepSpeed rows; run `source benchmarks/"
                     "peers_env.sh` first, or leave the deepspeed-* rows out of --systems")
    stop_on_sigterm()
    os.environ.update(worker_env(threads=1))  # DeepSpeed's CPU accelerator, the source tree on the path

    command = f"python -m benchmarks.cluster.zero3_layouts {' '.join(argv if argv is not None else sys.argv[1:])}"
    head = [f"Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; load before: {_uptime()}", "",
            f"Command: `{command}`", "",
            f"GPT: {args.layers} layers, hidden {args.hidden}, 2 heads, seq {args.seq}, vocab 128 (mock data: "
            f"`pretrain_gpt.py --mock-data` samples of 127 ids + eod), micro-batch {args.micro_batch} per rank, "
            f"{args.grad_accumulation} micro-batch(es) per rank per step, fp32, gloo, 1 thread per rank; our chunk "
            f"{args.page_size} elements; zero_optimization {json.dumps(BASE_ZERO_KEYS)} plus each layout's keys "
            f"(MiCS and hpZ blocks = ranks per host); {args.warmup} warm-up + {args.steps} timed steps, figures are "
            "medians of the timed steps.", ""]
    derivations, rows, bf16_lines = [], [], []
    with tempfile.TemporaryDirectory(prefix="ptm-zero3-layouts-") as tmp:
        with exits_on_cluster_failure("benchmarks.cluster.zero3_layouts"):
            for hosts, ranks, name, spec in shaped_clusters(topologies, profiles, args.max_delay_ms, derivations):
                world = hosts * ranks
                topology = f"{hosts}x{ranks}"
                base = BenchSpec(layers=args.layers, hidden=args.hidden, heads=2, vocab=128, seq=args.seq,
                                 micro_batch=args.micro_batch,
                                 global_batch=args.micro_batch * world * args.grad_accumulation, steps=args.steps,
                                 warmup=args.warmup, lr=1e-3, weight_decay=0.1, clip_grad=1.0, seed=1234,
                                 page_size=args.page_size, threads=1, mock_data_vocab=127)
                outcomes = []
                for variant in variants:
                    out_dir = Path(tmp) / f"{topology}-{name}-{variant.name}"
                    out_dir.mkdir()
                    spec_path = out_dir / "spec.json"
                    job_spec(base, variant, ranks).save(str(spec_path))
                    result = run_job(spec, ["-m", "benchmarks.peer_workers.worker", "--impl", variant.impl,
                                            "--system", variant.name, "--spec", str(spec_path),
                                            "--out-dir", str(out_dir)], args.timeout_s,
                                     python=args.peers_python if variant.peers else sys.executable)
                    outcomes.append(outcome(variant, result, out_dir, args.warmup))
                    if outcomes[-1].error is not None:
                        print("\n".join(result.output[-30:]), flush=True)
                    print(f"{topology} {name} {variant.name}: "
                          f"{outcomes[-1].error or f'{outcomes[-1].summary.seconds:.2f} s/step'}", flush=True)
                rows += table_rows(topology, name, outcomes, base.global_batch * base.seq)
                print("\n".join(rows[-len(outcomes):]), flush=True)
                bf16_lines.append(_zeropp_line(topology, name, outcomes, args.grad_accumulation))
    text = "\n".join([
        *head, *HEADER, *rows, "",
        "tokens/s: global batch x seq / median s/step. Inter-host bytes: every host's eth0 tx, intra-host: every "
        "host's lo tx (kernel counters read at each step line, headers included). \"vs flat\": against ours-flat "
        "(ours-*, ddp), deepspeed-flat (deepspeed-*) or fsdp2 (fsdp2-hsdp). bf16-equivalent: these runs move fp32 "
        "parameters and gradients; in bf16 an exact collective's bytes halve and an int8 one's do not, so "
        "B16 = B / 2 for a layout whose inter-host collectives are exact (flat, MiCS, hpZ, MiCS + qwZ, whose "
        "quantized gathers stay inside the host, HSDP, DDP) and B16 = B for ZeRO++ (qwZ's first gather and qgZ's "
        "all-to-all are int8; hpZ keeps the later gathers inside the host). Hence ZeRO++ vs flat in bf16 = "
        "2 x the measured fp32 ratio.", "",
        "ZeRO++ against flat, inter-host bytes (expected payload: (q_w + G q_g) / (3 G e), q_w = 1 + 4 / "
        f"{QUANT_BLOCK} bytes per int8 weight, q_g = 0.5 + 4 / {QUANT_BLOCK} per int4 gradient, e = 4 fp32 or 2 bf16 "
        f"bytes, G = {args.grad_accumulation} micro-batch(es) per step; the kernel's counts add packet headers and "
        "acknowledgements, which weigh more in small messages):", *bf16_lines, "",
        "Derivations:", *derivations, "", f"Load after: {_uptime()}", ""])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def _zeropp_line(topology: str, profile: str, outcomes: list[Outcome], micro_batches: int) -> str:
    ok = {o.variant.name: o.summary for o in outcomes if o.error is None}
    expected = (f"expected fp32 {zeropp_expected_ratio(micro_batches, bf16=False):.3f}, "
                f"bf16 {zeropp_expected_ratio(micro_batches):.3f}")
    if "ours-zero++" not in ok or "ours-flat" not in ok:
        return f"- {topology} {profile}: {expected}; not measured (a row failed or did not run)"
    measured = ok["ours-zero++"].inter_bytes / ok["ours-flat"].inter_bytes
    bf16 = bf16_inter_bytes(ok["ours-zero++"].inter_bytes, "zero++") / bf16_inter_bytes(
        ok["ours-flat"].inter_bytes, "flat")
    return f"- {topology} {profile}: {expected}; measured fp32 {measured:.3f}, bf16-equivalent {bf16:.3f}"


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
