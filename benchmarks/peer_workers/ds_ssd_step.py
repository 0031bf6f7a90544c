"""DeepSpeed's side of ``benchmarks.bench_ssd``, run in the peers' venv: its aio library's write/read GB/s on
the same files, and DeepSpeedCPUAdam's step on the same parameters. Prints one JSON line.

    python -m benchmarks.peer_workers.ds_ssd_step io --path /tmp --mib 512 --shards 8 --threads 4 \
        --block 1048576 --rounds 3
    python -m benchmarks.peer_workers.ds_ssd_step adam --params 16e6 --steps 10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _io(a) -> dict:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    handle = AsyncIOBuilder().load().aio_handle(block_size=a.block, queue_depth=8, single_submit=False,
                                                overlap_events=True, intra_op_parallelism=a.threads)
    numel = a.mib * 2**20 // 4 // a.shards
    buffers = [handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float32)) for _ in range(a.shards)]
    for b in buffers:
        b.normal_()
    paths = [os.path.join(a.path, f"bench_ds_aio_{i}.bin") for i in range(a.shards)]
    writes, reads = [], []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for b, p in zip(buffers, paths):
            handle.async_pwrite(b, p, 0)
        handle.wait()
        os.sync()
        writes.append(a.mib * 2**20 / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        for b, p in zip(buffers, paths):
            handle.async_pread(b, p, 0)
        handle.wait()
        reads.append(a.mib * 2**20 / (time.perf_counter() - t0) / 1e9)
    for b in buffers:
        handle.free_cpu_locked_tensor(b)
    for p in paths:
        os.unlink(p)
    return {"write_gbs": statistics.median(writes), "read_gbs": statistics.median(reads)}


def _adam(a) -> dict:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    layers = max(1, round(a.params / (1024 * 1025)))
    params = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(layers)]
    params += [torch.nn.Parameter(torch.randn(1024)) for _ in range(layers)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
    times = []
    for s in range(a.steps + 1):
        t0 = time.perf_counter()
        opt.step()
        if s:  # the first step allocates the moments
            times.append(time.perf_counter() - t0)
    return {"elements_per_s": sum(p.numel() for p in params) / statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("io", "adam"))
    ap.add_argument("--path", default="/tmp")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=3, help="I/O: write and read this many times, report medians")
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--steps", type=int, default=10, help="adam: steps after a warm-up one, median reported")
    a = ap.parse_args()
    print(json.dumps(_io(a) if a.what == "io" else _adam(a)), flush=True)


if __name__ == "__main__":
    main()
