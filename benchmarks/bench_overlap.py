"""How much host <-> device copy time the engine hides behind compute, measured with the emulated accelerator.

    python -m benchmarks.bench_overlap --quick     # ~2 minutes on 2 cores: 4 blocks of hidden 256, 2 rounds x 4 steps
    python -m benchmarks.bench_overlap             # ~15 minutes: 8 blocks of hidden 384, 3 rounds x 6 steps

One process (DP 1), ZeRO-3 with parameters and optimizer states in host memory (offload cpu, pageable),
fp32, two micro-batches per step, on a stack of MLP blocks. The emulated accelerator
(``zero_optimization.emulated_accelerator``) makes every parameter gather a host-to-device copy and every
gradient shard a device-to-host copy, run on their own streams at a set bandwidth. For each configuration:

1. compute: the step time with copies at 1e6 GB/s (no transfer cost; everything else the same, staging
   included);
2. the bytes each step copies, from the engine's copy report of a calibration run; from them two
   bandwidths: one that makes the copies take half the compute time (transfers smaller than compute) and
   one that makes them take twice it (larger);
3. the step time at each bandwidth. Transfer = the copy time the engine issued (sum of the copies'
   durations). Hidden = (compute + transfer - step) / transfer: the share of the transfer time that did
   not lengthen the step. Also the engine's own figure, 1 - blocked / issued.

With two copy streams (one per direction) the step can hide at most compute / transfer of the transfer
time when the transfers are larger (about 50% at twice the compute), plus what the two directions overlap.

Configurations: prefetch_cache_sub_group_rate 0 and 0.5 (the heterogeneous step), and the speculative host
update at the smaller bandwidth with clipping that never acts (speculation accepted) and always acts (every
speculation restored and redone), against the same runs without it. Step times are medians over the timed
steps of all rounds. The table goes to stdout and benchmarks/results/bench_overlap.md, the raw per-step
figures to benchmarks/logs/bench_overlap-<date>/steps.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
from torch import nn

import zero_cache
from benchmarks.peer_workers.harness import LOGS_DIR, RESULTS_DIR

INSTANT_GBPS = 1e6


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return (x.float() ** 2).mean()


def _config(args, gbps: float, rate: float, speculative: bool, clip: float) -> dict:
    layer = 8 * args.hidden * args.hidden + 7 * args.hidden  # parameters of one block: one chunk each
    zero = {"stage": 3, "allgather_bucket_size": layer, "sub_group_size": 2 * layer,
            "stage3_param_persistence_threshold": 4 * args.hidden, "stage3_prefetch_bucket_size": layer,
            "stage3_max_live_parameters": 3 * layer, "stage3_max_reuse_distance": 0,
            "prefetch_cache_sub_group_rate": rate, "speculative_update": speculative,
            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
            "emulated_accelerator": {"enabled": True, "h2d_gbps": gbps, "d2h_gbps": gbps,
                                     "random_delay_ms": args.random_delay_ms}}
    return {"train_batch_size": 2 * args.micro_batch, "gradient_accumulation_steps": 2, "gradient_clipping": clip,
            "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_optimization": zero}


def _run(args, gbps: float, rate: float = 0.0, speculative: bool = False, clip: float = 0.0) -> dict:
    """Per-step wall times and copy reports of one configuration (warm-up steps dropped)."""
    torch.manual_seed(0)
    model = Stack(args.layers, args.hidden)
    engine = zero_cache.initialize(model=model, config=_config(args, gbps, rate, speculative, clip))
    g = torch.Generator().manual_seed(1)
    steps, issued, blocked, nbytes, accepted = [], [], [], [], 0
    for s in range(args.warmup + args.steps):
        xs = [torch.randn(args.micro_batch, args.seq, args.hidden, generator=g) for _ in range(2)]
        t0 = time.perf_counter()
        for x in xs:
            engine.backward(engine(x))
        engine.step()
        dt = time.perf_counter() - t0
        stats = engine.copy_stats()
        if s >= args.warmup:
            steps.append(dt)
            issued.append(stats.issued_seconds)
            blocked.append(stats.blocked_seconds)
            nbytes.append(stats.h2d_bytes + stats.d2h_bytes)
            if engine.last_speculation is not None:
                accepted += engine.last_speculation.accepted
    engine.close()
    return {"gbps": gbps, "rate": rate, "speculative": speculative, "clip": clip, "step_s": steps,
            "issued_s": issued, "blocked_s": blocked, "bytes": nbytes, "accepted": accepted}


def _pooled(runs: list[dict], key: str) -> float:
    return statistics.median(v for r in runs for v in r[key])


def _measure(args, label: str, log: list, **kw) -> dict:
    """Compute time, then the step at the two bandwidths: a calibration run picks the bandwidths, then
    ``args.rounds`` rounds of the three runs in turn (so a change of machine load hits all three), pooled."""
    calib = _run(args, INSTANT_GBPS, **kw)
    per_step, guess = statistics.median(calib["bytes"]), statistics.median(calib["step_s"])
    shares = (("smaller", 0.5), ("larger", 2.0))
    bandwidths = {name: per_step / (share * guess) / 1e9 for name, share in shares}
    runs = {"compute": [], **{name: [] for name, _ in shares}}
    for _ in range(args.rounds):
        runs["compute"].append(_run(args, INSTANT_GBPS, **kw))
        for name, _ in shares:
            runs[name].append(_run(args, bandwidths[name], **kw))
    log.append({"label": label, **runs})
    compute = _pooled(runs["compute"], "step_s")
    out = {"label": label, "compute_s": compute, "bytes": per_step, "rows": [], "smaller_gbps": bandwidths["smaller"]}
    for name, _ in shares:
        step, transfer = _pooled(runs[name], "step_s"), _pooled(runs[name], "issued_s")
        blocked = _pooled(runs[name], "blocked_s")
        hidden = min(1.0, max(0.0, (compute + transfer - step) / transfer)) if transfer > 0 else 1.0
        out["rows"].append({"name": name, "gbps": bandwidths[name], "step_s": step, "transfer_s": transfer,
                            "hidden": hidden, "engine_hidden": max(0.0, transfer - blocked) / transfer})
    return out


def _speculation(args, log: list, gbps: float) -> list[dict]:
    """Step time with and without the speculative host update at one bandwidth, clipping never or always."""
    rows = []
    for clip_name, clip in (("never clips", 0.0), ("always clips", 1e-6)):
        runs = {spec: [_run(args, gbps, speculative=spec, clip=clip) for _ in range(args.rounds)]
                for spec in (False, True)}
        log.append({"speculation": clip_name, "gbps": gbps, "runs": runs})
        off, on = _pooled(runs[False], "step_s"), _pooled(runs[True], "step_s")
        rows.append({"clip": clip_name, "off_s": off, "on_s": on, "gain": off / on - 1.0,
                     "accepted": sum(r["accepted"] for r in runs[True]),
                     "steps": args.rounds * args.steps})
    return rows


def _table(args, results: list[dict], spec: list[dict], started: str) -> str:
    lines = [f"# bench_overlap ({'quick' if args.quick else 'full'} mode)", "",
             f"{started}; {platform.node()}: {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s); {args.layers} blocks of hidden {args.hidden} "
             f"({sum(8 * args.hidden ** 2 + 7 * args.hidden for _ in range(args.layers)) / 1e6:.2f}M parameters), "
             f"micro-batch {args.micro_batch} x seq {args.seq}, 2 micro-batches per step, fp32, DP 1, offload cpu; "
             f"emulated random delay {args.random_delay_ms} ms per copy; {args.rounds} round(s) x {args.steps} "
             f"timed steps (medians)", "",
             "| configuration | transfers vs compute | bandwidth (GB/s) | compute (s) | transfer (s) | "
             "compute + transfer (s) | step (s) | hidden | engine: 1 - blocked/issued |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for row in res["rows"]:
            lines.append(f"| {res['label']} | {row['name']} | {row['gbps']:.3f} | {res['compute_s']:.3f} | "
                         f"{row['transfer_s']:.3f} | {res['compute_s'] + row['transfer_s']:.3f} | "
                         f"{row['step_s']:.3f} | {100 * row['hidden']:.0f}% | {100 * row['engine_hidden']:.0f}% |")
    gbps = results[0]["smaller_gbps"]
    lines += ["", f"Speculative host update at the smaller bandwidth of rate 0 ({gbps:.3f} GB/s):",
              "", "| clipping | step without (s) | step with (s) | gain | speculations accepted |",
              "|---|---:|---:|---:|---:|"]
    for row in spec:
        lines.append(f"| {row['clip']} | {row['off_s']:.3f} | {row['on_s']:.3f} | {100 * row['gain']:+.1f}% | "
                     f"{row['accepted']} sub-groups in {row['steps']} steps |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 blocks of hidden 256, 3 timed steps, 1 round")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--random-delay-ms", type=float, default=0.2)
    p.add_argument("--table", default=os.path.join(RESULTS_DIR, "bench_overlap.md"))
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    quick = {"layers": 4, "hidden": 256, "steps": 4, "rounds": 2}
    full = {"layers": 8, "hidden": 384, "steps": 6, "rounds": 3}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    log: list = []
    results = [_measure(args, "rate 0", log), _measure(args, "rate 0.5 (device + host lanes)", log, rate=0.5)]
    spec = _speculation(args, log, results[0]["smaller_gbps"])
    table = _table(args, results, spec, started)
    print(table)
    if args.table:
        os.makedirs(os.path.dirname(args.table), exist_ok=True)
        with open(args.table, "w", encoding="utf-8") as f:
            f.write(table)
    log_dir = args.log_dir or os.path.join(LOGS_DIR, f"bench_overlap-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "steps.json"), "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "runs": log}, f, indent=1)


if __name__ == "__main__":
    main()
