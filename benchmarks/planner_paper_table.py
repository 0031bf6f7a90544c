"""The planner's step-time model against a published table: Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (SC 2021), Table 1: GPT from 1.7B parameters on 32 A100s to 1T on 3072,
achieved TFLOP/s per GPU as the paper counts it (its formula, with the recomputed forward).

    python -m benchmarks.planner_paper_table                       # predict every row with the profile as it is
    python -m benchmarks.planner_paper_table --calibrate 1.7B,145.6B,1008.0B \
        --out benchmarks/results/planner_paper_table.md

The runs' settings are those of Megatron-LM's examples/sc21/run_table_1.sh: sequence 2048, vocabulary 51,200, fp16,
full recompute (uniform), materialized attention with dropout (the 2021 kernels; no flash attention), no sequence
parallelism, the interleaved schedule where the script gives --num-layers-per-virtual-pipeline-stage, torch DDP
(overlapped) for the first four rows and Megatron's local DDP (after the backward) for the rest, gradients reduced
in fp16. --calibrate fits the A100's shares of peak FLOP/s (large GEMMs) and of memory bandwidth (elementwise
kernels) on at most three rows (grid search, least largest error) and predicts the rest with them; the profile
``a100-40g-hdr`` (DGX A100, 200 Gb/s HDR per GPU) gives every other number.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from dataclasses import dataclass

from ptm_planner.profiles import PROFILES, ClusterProfile
from ptm_planner.step_model import DataParallel, ModelShape, Parallel, Workload, predict

SEQ, VOCAB = 2048, 51200
GOAL = 0.15  # the bound on held-out rows


@dataclass(frozen=True)
class Row:
    name: str  # billions of parameters, as the table prints them
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    micro_batch: int
    global_batch: int
    layers_per_virtual_stage: int | None
    local_ddp: bool
    published_tflops: float  # achieved TFLOP/s per GPU

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def virtual_stages(self) -> int:
        per_stage = self.layers // self.pp
        return per_stage // self.layers_per_virtual_stage if self.layers_per_virtual_stage else 1

    def paper_flops(self) -> float:
        """The paper's FLOPs of one iteration: 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
        b, s, layers, h = self.global_batch, SEQ, self.layers, self.hidden
        return 96 * b * s * layers * h * h * (1 + s / (6 * h) + VOCAB / (16 * layers * h))

    def workload(self) -> Workload:
        model = ModelShape(self.layers, self.hidden, self.heads, self.heads, self.hidden // self.heads,
                           4 * self.hidden, VOCAB, SEQ)
        parallel = Parallel(tp=self.tp, pp=self.pp, dp=self.dp, virtual_stages=self.virtual_stages)
        return Workload(model, parallel, self.micro_batch, self.micro_batches, recompute="full",
                        attention="materialized", dtype_bytes=2,
                        data_parallel=DataParallel("ddp", overlap=not self.local_ddp, grad_bytes=2))


# Table 1 of the paper (heads, hidden, layers, TP, PP, GPUs, batch, achieved TFLOP/s per GPU), with the micro-batch
# and interleaving of examples/sc21/run_table_1.sh.
ROWS = [
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 16, 512, None, False, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 16, 512, None, False, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 16, 512, None, False, 142),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 8, 1024, None, False, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 4, 1536, None, True, 138),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 2, 1792, 5, True, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2, 2304, 5, True, 148),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 1, 2160, 3, True, 155),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 1, 2520, 1, True, 163),
    Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 1, 3072, None, True, 163),
]


def predicted_tflops(row: Row, profile: ClusterProfile) -> tuple[float, float]:
    """(TFLOP/s per GPU in the paper's count, step seconds)."""
    step = predict(row.workload(), profile).step_s
    return row.paper_flops() / step / row.gpus / 1e12, step


def with_shares(profile: ClusterProfile, gemm: float, memory: float) -> ClusterProfile:
    acc = dataclasses.replace(profile.accelerator, gemm_efficiency=gemm, memory_efficiency=memory)
    return dataclasses.replace(profile, accelerator=acc)


def calibrate(rows: list[Row], profile: ClusterProfile) -> tuple[float, float]:
    """The shares of peak FLOP/s (large GEMMs) and of memory bandwidth (elementwise kernels) whose largest
    relative error over ``rows`` is least (grid of 0.01)."""
    best = None
    for gemm in range(50, 96):
        for memory in range(40, 96):
            p = with_shares(profile, gemm / 100, memory / 100)
            err = max(abs(predicted_tflops(r, p)[0] / r.published_tflops - 1) for r in rows)
            if best is None or err < best[0]:
                best = (err, gemm / 100, memory / 100)
    return best[1], best[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="a100-40g-hdr", choices=list(PROFILES))
    parser.add_argument("--calibrate", default="", help="rows to fit the GEMM constants on (at most 3), e.g. "
                                                        "1.7B,145.6B,1008B; default: the profile's constants")
    parser.add_argument("--out", help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    names = [n for n in args.calibrate.split(",") if n]
    by_name = {r.name: r for r in ROWS}
    if unknown := [n for n in names if n not in by_name]:
        parser.error(f"--calibrate: unknown rows {unknown}; rows: {', '.join(by_name)}")
    if len(names) > 3:
        parser.error("--calibrate takes at most three rows")
    acc = profile.accelerator
    note = f"the profile's constants (gemm_efficiency {acc.gemm_efficiency:g}, memory_efficiency " \
           f"{acc.memory_efficiency:g}; gemm_call_us {acc.gemm_call_us:g})"
    if names:
        gemm, memory = calibrate([by_name[n] for n in names], profile)
        profile = with_shares(profile, gemm, memory)
        note = f"calibrated on {', '.join(names)}: gemm_efficiency {gemm:g}, memory_efficiency {memory:g} " \
               f"(gemm_call_us {acc.gemm_call_us:g}, not fitted)"
    lines = [f"Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
             "", f"Command: `python -m benchmarks.planner_paper_table {' '.join(argv or sys.argv[1:])}`", "",
             f"Profile {profile.name} ({profile.summary}); {note}.", "",
             "| parameters | TP | PP | v | GPUs | micro-batch | micro-batches | published TFLOP/s per GPU | "
             "predicted | error | used for | predicted step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for r in ROWS:
        tflops, step = predicted_tflops(r, profile)
        err = tflops / r.published_tflops - 1
        held_out = r.name not in names
        if held_out:
            worst = max(worst, abs(err))
        lines.append(f"| {r.name} | {r.tp} | {r.pp} | {r.virtual_stages} | {r.gpus} | {r.micro_batch} | "
                     f"{r.micro_batches} | {r.published_tflops:g} | {tflops:.1f} | {err:+.1%} | "
                     f"{'held out' if held_out else 'calibration'} | {step:.2f} |")
    verdict = "within" if worst <= GOAL else "OUTSIDE"
    lines += ["", f"Largest error on a held-out row: {worst:.1%} ({verdict} the {GOAL:.0%} goal)."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
