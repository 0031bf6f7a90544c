"""Flat ZeRO-3 against the hierarchical layouts at scale, projected by the planner's step-time model: GPT-3 175B on 64,
512 and 1024 A100s and Llama-3 70B on 512 H100s (docs/zero_cache/hierarchical.md; pure arithmetic, seconds).

    python -m benchmarks.planner_projections --out benchmarks/results/planner_projections.md

Every run is ZeRO-3 data parallelism alone (no TP or PP), bf16, full recompute, flash attention, micro-batch 1,
and a fixed global batch (GPT-3: 1,536 sequences of 2,048 tokens, its paper's 3.2M tokens; Llama-3: 1,024 of
8,192), so a replica's micro-batches per step fall as GPUs are added. Layouts: flat; hpZ (secondary shards in the
node); MiCS (shard groups of a node); ZeRO++ (hpZ + int8 weight gathers + int4 gradients across nodes). Model
states per GPU: 2 bytes of bf16 parameters and 16 of fp32 gradient, master and Adam moments per element over the
shard group, plus hpZ's bf16 secondary shard; a layout whose states exceed the GPU's memory is marked, since it
could only run with the states on the host or SSD tiers, which this projection does not price.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass

from ptm_planner.profiles import GB, PROFILES, ClusterProfile
from ptm_planner.step_model import DataParallel, ModelShape, Parallel, Workload, predict

GiB = 2**30
LAYOUTS = {
    "flat": DataParallel("zero3"),
    "hpz": DataParallel("zero3", layout="hpz"),
    "mics": DataParallel("zero3", layout="mics"),
    "zero++": DataParallel("zero3", layout="hpz", quantized_weights=True, quantized_gradient_bits=4),
}


@dataclass(frozen=True)
class Case:
    model_name: str
    model: ModelShape
    profile: str
    gpus: int
    global_batch: int


GPT3 = ModelShape(layers=96, hidden=12288, heads=96, query_groups=96, head_dim=128, ffn=49152, vocab=50304,
                  seq=2048)
LLAMA3_70B = ModelShape(layers=80, hidden=8192, heads=64, query_groups=8, head_dim=128, ffn=28672, vocab=128256,
                        seq=8192, swiglu=True, attention_dropout=False)
CASES = [Case("GPT-3 175B", GPT3, profile, gpus, 1536) for profile in ("a100-80g-hdr", "a100-eth")
         for gpus in (64, 512, 1024)] + [Case("Llama-3 70B", LLAMA3_70B, "h100", 512, 1024)]


def states_per_gpu(params: int, shard: int, node: int, layout: str) -> float:
    group = node if layout == "mics" else shard
    secondary = 2 * params / node if layout in ("hpz", "zero++") else 0
    return (18 * params / group + secondary) / GiB


def project(case: Case, layout: str) -> tuple[float, float, float, bool]:
    """(tokens/s per GPU, MFU, model states GiB per GPU, whether the states fit in the GPU's memory)."""
    profile: ClusterProfile = PROFILES[case.profile]
    params = case.model.params()
    work = Workload(case.model, Parallel(dp=case.gpus), micro_batch=1,
                    micro_batches=max(1, case.global_batch // case.gpus), recompute="full", attention="flash",
                    dtype_bytes=2, data_parallel=LAYOUTS[layout])
    pred = predict(work, profile)
    states = states_per_gpu(params, case.gpus, profile.gpus_per_node, layout)
    return pred.tokens_per_s / case.gpus, pred.mfu, states, states * GiB < profile.accelerator.memory_gib * GB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    lines = [f"Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}", "",
             f"Command: `python -m benchmarks.planner_projections {' '.join(argv or sys.argv[1:])}`", "",
             "| model | profile | GPUs | micro-batches per step | layout | tokens/s per GPU | vs flat | MFU | "
             "model states GiB per GPU |", "|---|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        flat = project(case, "flat")[0]
        for layout in LAYOUTS:
            tps, mfu, states, fits = project(case, layout)
            lines.append(f"| {case.model_name} | {case.profile} | {case.gpus} | "
                         f"{max(1, case.global_batch // case.gpus)} | {layout} | {tps:,.0f} | {tps / flat:.2f}x | "
                         f"{mfu:.0%} | {states:.1f}{'' if fits else ' (exceeds the GPU)'} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
