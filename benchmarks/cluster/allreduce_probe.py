"""A gloo all-reduce of a known size, for checking which links carry a job's bytes (run under torchrun).

    python -m benchmarks.cluster.run --hosts 2 --ranks-per-host 2 -- benchmarks/cluster/allreduce_probe.py 1048576

Rank r contributes a tensor of NUMEL float32 elements all equal to r + 1; every rank checks the sum.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main() -> None:
    numel = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((numel,), float(rank + 1))
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    if not bool((t == expected).all()):
        raise SystemExit(f"allreduce_probe: rank {rank} got {t[0].item()}, expected {expected}")
    dist.barrier()
    if rank == 0:
        print(f"allreduce_probe: {numel} float32 elements over {world} ranks: sum {expected:g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
