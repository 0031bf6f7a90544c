"""SSD tier benchmark: page-file write/read GB/s against dd with O_DIRECT and DeepSpeed's aio on the same
disk, and optimizer step elements/s with the states on the host and on SSD against torch's fused AdamW and
DeepSpeedCPUAdam, all in one run. Prints a table.

    python -m benchmarks.bench_ssd [--nvme-path /tmp] [--mib 512] [--shards 8] [--params 16e6] [--steps 10] [--rounds 3]

1. I/O: ``--mib`` MiB split into ``--shards`` page files of zero_cache's SSDStore (O_DIRECT, XXH3-64 per page)
   written (swap_out) and read back (swap_in) ``--rounds`` times (medians) for each
   ``aio.intra_op_parallelism`` / ``block_size`` setting, ``queue_depth`` 8; the references are
   ``dd bs=1M oflag=direct`` / ``iflag=direct`` of the same amount on the same disk, and DeepSpeed's aio
   library (``aio_handle``: the same files, threads, block size, queue depth and rounds).
2. Optimizer: a stack of 1024x1024 Linear layers (``--params`` parameters) through the zero_cache engine
   (stage 3, DP 1), states on the host (offload_optimizer cpu) and on SSD (nvme, pipelined and not), timing
   ``engine.step()`` only; torch.optim.AdamW(fused=True) and DeepSpeedCPUAdam (AdamW mode, its AVX kernel)
   on the same parameter shapes are the references. Medians over ``--steps`` steps. The host row and the
   fused kernel take their steps in turn, in a rotating order, so a drift of the machine's speed reaches
   both alike; then the two SSD rows the same way.

DeepSpeed's rows run in the peers' venv (``source benchmarks/peers_env.sh`` once;
``benchmarks/peer_workers/ds_ssd_step.py``); without it they are left out with a note. Run from the
repository root.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch
from torch import nn

import zero_cache
from benchmarks.peer_workers.harness import PEERS_PYTHON, ROOT, worker_env
from zero_cache.config import AioConfig
from zero_cache.ssd_store import SSDStore


def _dd(path: str, mib: int) -> tuple[float, float]:
    """dd O_DIRECT write and read GB/s of ``mib`` MiB at ``path``."""
    def rate(args):
        out = subprocess.run(args, capture_output=True, text=True, check=True).stderr
        m = re.search(r"copied, ([\d.]+) s", out)
        return mib * 2**20 / float(m.group(1)) / 1e9
    w = rate(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
    r = rate(["dd", f"if={path}", "of=/dev/null", "bs=1M", f"count={mib}", "iflag=direct"])
    os.unlink(path)
    return w, r


def _store_io(root: str, mib: int, shards: int, threads: int, block: int, rounds: int) -> tuple[float, float]:
    """Median write and read GB/s over ``rounds`` (this virtual disk varies by +-20% from one pass to the next)."""
    store = SSDStore(torch.device("cpu"), root,
                     AioConfig(block_size=block, queue_depth=8, intra_op_parallelism=threads))
    numel = mib * 2**20 // 4 // shards
    keys = [f"s{i}" for i in range(shards)]
    for k in keys:
        store.allocate(k, "optimizer", "nvme", numel, torch.float32)
    tensors = store.swap_in(keys).wait()
    for t in tensors:
        t.normal_()
    writes, reads = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        store.swap_out(keys, tensors).wait()
        os.sync()
        writes.append(mib * 2**20 / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        tensors = store.swap_in(keys).wait()
        reads.append(mib * 2**20 / (time.perf_counter() - t0) / 1e9)
    store.release(tensors)
    store.close()
    return statistics.median(writes), statistics.median(reads)


def _deepspeed(*args: str) -> dict | None:
    """One DeepSpeed measurement in the peers' venv (None, with a note, when it is missing or fails)."""
    if not os.path.exists(PEERS_PYTHON):
        print("  DeepSpeed: peers' venv missing (source benchmarks/peers_env.sh); row left out", flush=True)
        return None
    res = subprocess.run([PEERS_PYTHON, "-m", "benchmarks.peer_workers.ds_ssd_step", *args], capture_output=True,
                         text=True, env=worker_env(torch.get_num_threads()), cwd=ROOT)  # the threads our rows use
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        print(f"  DeepSpeed {args[0]} failed (exit {res.returncode}): {(res.stderr or res.stdout)[-400:]}", flush=True)
        return None
    return json.loads(lines[-1])


def _model(params: float) -> nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(params / (1024 * 1025)))
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])


def _engine_stepper(params: float, offload: dict, pipeline: bool):
    """(parameters, a function that runs one training step and returns the seconds of the optimizer update,
    the engine) for the zero_cache engine with the optimizer states where ``offload`` puts them. With states
    on SSD the update would otherwise end under the next forward (``overlap_optimizer_step``): it is timed to
    its end."""
    model = _model(params)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "allgather_bucket_size": 1 << 22, "sub_group_size": 1 << 22,
                                 "stage3_param_persistence_threshold": 2048, "pipeline_optimizer": pipeline,
                                 "offload_optimizer": offload}}
    engine = zero_cache.initialize(model=model, config=cfg)
    x = torch.randn(2, 1024)

    def step() -> float:
        engine.backward(engine(x).square().mean())
        t0 = time.perf_counter()
        engine.step()
        engine.finish_update()
        return time.perf_counter() - t0
    return sum(p.numel() for p in model.parameters()), step, engine


def _fused_stepper(params: float):
    """The same for torch.optim.AdamW(fused=True) on the model's parameters, gradients set once."""
    model = _model(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)

    def step() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0
    return sum(p.numel() for p in model.parameters()), step, None


def _interleaved(rows: dict, steps: int) -> list[tuple[str, float, object]]:
    """(name, elements/s, SSD traffic of the last step) of each row: median over ``steps`` steps after one
    warm-up step. The rows take their steps in turn, in an order rotated every round, so that they see the
    same machine and none always runs right after the same other one (a row's memory traffic slows the
    next one's first accesses)."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    for s in range(steps + 1):
        for name in names[s % len(names):] + names[:s % len(names)]:
            t = rows[name][1]()
            if s:  # the first step allocates the moments and warms up
                times[name].append(t)
    out = []
    for name, (n, _, engine) in rows.items():
        stats = engine.swap_stats() if engine is not None else None
        if engine is not None:
            engine.close()
        out.append((name, n / statistics.median(times[name]), stats))
    return out


def _optimizer_rows(params: float, steps: int, nvme_path: str) -> list[tuple[str, float, object]]:
    """The in-process rows: the states in memory against the bare kernel, then the two SSD rows."""
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    out = _interleaved({"torch AdamW(fused=True), in memory": _fused_stepper(params),
                        "zero_cache, states on host": _engine_stepper(params, {"device": "cpu"}, True)}, steps)
    return out + _interleaved({"zero_cache, states on SSD, pipelined": _engine_stepper(params, nvme, True),
                               "zero_cache, states on SSD, not pipelined": _engine_stepper(params, nvme, False)},
                              steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per row (medians reported)")
    ap.add_argument("--rounds", type=int, default=3, help="I/O passes per setting (medians reported)")
    ap.add_argument("--part", choices=("all", "io", "optimizer"), default="all", help="run one of the two parts")
    args = ap.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    if args.part != "optimizer":
        rows = []
        print(f"[1/3] dd O_DIRECT, {args.mib} MiB ...", flush=True)
        w, r = _dd(os.path.join(args.nvme_path, "bench_ssd_dd.bin"), args.mib)
        rows.append(("dd bs=1M O_DIRECT", f"{w:.2f}", f"{r:.2f}"))
        settings = [(1, 1 << 20), (2, 1 << 20), (4, 1 << 20), (2, 8 << 20)]
        for k, (threads, block) in enumerate(settings):
            print(f"[2/3] SSD tier threads={threads} block={block >> 20}MiB ({k + 1}/{len(settings)}) ...", flush=True)
            w, r = _store_io(args.nvme_path, args.mib, args.shards, threads, block, args.rounds)
            rows.append((f"zero_cache SSD tier, {threads} thr, {block >> 20} MiB blocks", f"{w:.2f}", f"{r:.2f}"))
            ds = _deepspeed("io", "--path", args.nvme_path, "--mib", str(args.mib), "--shards", str(args.shards),
                            "--threads", str(threads), "--block", str(block), "--rounds", str(args.rounds))
            if ds is not None:
                rows.append((f"DeepSpeed aio, {threads} thr, {block >> 20} MiB blocks", f"{ds['write_gbs']:.2f}",
                             f"{ds['read_gbs']:.2f}"))
        print(f"\n{'I/O (' + str(args.mib) + ' MiB)':<48} {'write GB/s':>10} {'read GB/s':>10}")
        for name, w, r in rows:
            print(f"{name:<48} {w:>10} {r:>10}")
    if args.part == "io":
        return
    print(f"\n[3/3] optimizer step, {args.params / 1e6:.0f}M params ...", flush=True)
    opt_rows = _optimizer_rows(args.params, args.steps, args.nvme_path)
    ds = _deepspeed("adam", "--params", str(args.params), "--steps", str(args.steps))
    if ds is not None:
        opt_rows.insert(1, ("DeepSpeedCPUAdam, in memory", ds["elements_per_s"], None))
    print(f"{'optimizer step':<48} {'Melem/s':>10}  SSD traffic of the last step")
    for name, rate, stats in opt_rows:
        print(f"{name:<48} {rate / 1e6:>10.1f}  {stats or ''}")


if __name__ == "__main__":
    main()
