"""Where one training step of ours goes, per rank: torch.profiler's CPU op table of one step of the zero_cache
worker (benchmarks/peer_workers/ours.py) on a spec written by moe_vs_peers.py or zero3_vs_peers.py.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.profile_step \\
        --spec benchmarks/logs/moe/main2/spec_moe.json --out benchmarks/logs/profile_moe

Runs --warm steps untimed, then profiles one step and writes ``OUT_rank{r}.txt``: the step's wall time, the ops
by self CPU time, and the same grouped by input shapes (which copy is which). fp32 on the CPU, gloo.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.peer_workers.harness import BenchSpec, synthetic_tokens
from benchmarks.peer_workers.ours import ZeroCacheTrainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="a BenchSpec JSON (spec_moe.json, spec_dense.json, spec.json)")
    p.add_argument("--out", required=True, help="path prefix of the per-rank tables")
    p.add_argument("--warm", type=int, default=2, help="untimed steps before the profiled one")
    p.add_argument("--offload", action="store_true", help="the ours-offload system")
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    spec = BenchSpec.load(a.spec)
    if spec.steps + spec.warmup < a.warm + 1:
        raise SystemExit(f"profile_step.py: the spec has {spec.warmup + spec.steps} steps of batches; "
                         f"--warm {a.warm} needs {a.warm + 1}")
    dist.init_process_group("gloo")
    torch.set_num_threads(spec.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = spec.grad_accumulation(world)
    trainer = ZeroCacheTrainer(ZeroCacheTrainer.build_model(spec, a.offload), spec, gas, a.offload)
    tokens = synthetic_tokens(spec)
    positions = torch.arange(spec.seq).expand(spec.micro_batch, spec.seq)

    def step(s: int) -> None:
        for m in range(gas):
            first = (m * world + rank) * spec.micro_batch
            batch = tokens[s, first:first + spec.micro_batch]
            trainer.micro_batch(batch[:, :-1], positions, batch[:, 1:], last=m == gas - 1)
        dist.barrier()

    for s in range(a.warm):
        step(s)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(a.warm)
    wall = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(f"{a.out}_rank{rank}.txt", "w", encoding="utf-8") as f:
        f.write(f"{a.spec}: one step (step {a.warm + 1}) on rank {rank}: {wall:.2f} s wall\n\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows,
                                          max_name_column_width=60) + "\n")
        f.write("by input shape (self CPU ms, calls, op, shapes):\n")
        by_shape = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
        for e in by_shape[:a.rows]:
            f.write(f"{e.self_cpu_time_total / 1e3:10.1f} {e.count:6d}  {e.key}  {e.input_shapes}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
