"""How much host <-> device copy time the engine hides behind compute, measured with the emulated accelerator.

    python -m benchmarks.bench_overlap --quick     # ~1.5 minutes on 2 cores: 4 blocks of hidden 256, 8 steps each
    python -m benchmarks.bench_overlap             # ~10 minutes: 8 blocks of hidden 384, 24 steps each

One process (DP 1), ZeRO-3 with parameters and optimizer states in host memory (offload cpu, pageable),
fp32, two micro-batches per step, on a stack of MLP blocks. The emulated accelerator
(``zero_optimization.emulated_accelerator``) makes every parameter gather a host-to-device copy and every
gradient shard a device-to-host copy, run on their own streams at a set bandwidth. For each configuration:

1. compute: the step time with copies at 1e6 GB/s (no transfer cost; everything else the same, staging
   included), measured twice by two identical engines: their difference is the noise of the machine;
2. the bytes each step copies, from the engine's copy report of a calibration run; from them two
   bandwidths: one that makes the copies take half the compute time (transfers smaller than compute) and
   one that makes them take twice it (larger);
3. the step time at each bandwidth, the three engines alive at once and stepped in turn (so a change of
   machine load hits all of them alike). Transfer = the copy time the engine issued (sum of the copies'
   durations). Hidden = (compute + transfer - step) / transfer: the share of the transfer time that did
   not lengthen the step. Also the engine's own figure, 1 - blocked / issued.

With two copy streams (one per direction) the step can hide at most compute / transfer of the transfer
time when the transfers are larger (about 50% at twice the compute), plus what the two directions overlap.

Configurations: prefetch_cache_sub_group_rate 0, and 0.5 at the same bandwidths (the heterogeneous step:
half the sub-groups update on the device beside the host lane, and less is copied), and the speculative
host update at the smaller bandwidth with clipping that never acts (speculation accepted) and always acts
(every speculation restored and redone), against the same runs without it, all four stepped in turn. Step
times are medians over the timed steps. The table goes to stdout and benchmarks/results/bench_overlap.md,
the raw per-step figures to benchmarks/logs/bench_overlap-<date>/steps.json.
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


class Runner:
    """One engine and its batches; ``step()`` runs one training step and records its time and copy report."""

    def __init__(self, args, gbps: float, rate: float = 0.0, speculative: bool = False, clip: float = 0.0):
        torch.manual_seed(0)
        self.args, self.gbps = args, gbps
        self.engine = zero_cache.initialize(model=Stack(args.layers, args.hidden),
                                            config=_config(args, gbps, rate, speculative, clip))
        self.gen = torch.Generator().manual_seed(1)
        self.record = {"gbps": gbps, "rate": rate, "speculative": speculative, "clip": clip, "step_s": [],
                       "issued_s": [], "blocked_s": [], "bytes": [], "accepted": 0}
        self.done = 0

    def step(self) -> None:
        a = self.args
        xs = [torch.randn(a.micro_batch, a.seq, a.hidden, generator=self.gen) for _ in range(2)]
        t0 = time.perf_counter()
        for x in xs:
            self.engine.backward(self.engine(x))
        self.engine.step()
        dt = time.perf_counter() - t0
        stats, spec = self.engine.copy_stats(), self.engine.last_speculation
        self.done += 1
        if self.done > a.warmup:
            r = self.record
            r["step_s"].append(dt)
            r["issued_s"].append(stats.issued_seconds)
            r["blocked_s"].append(stats.blocked_seconds)
            r["bytes"].append(stats.h2d_bytes + stats.d2h_bytes)
            r["accepted"] += spec.accepted if spec is not None else 0

    def close(self) -> dict:
        self.engine.close()
        return self.record


def _interleaved(args, runners: list[Runner]) -> list[dict]:
    """Step every runner in turn (the order rotating), so a change of machine load hits all of them alike."""
    for s in range(args.warmup + args.steps):
        k = s % len(runners)
        for r in runners[k:] + runners[:k]:
            r.step()
    return [r.close() for r in runners]


def _median(record: dict, key: str) -> float:
    return statistics.median(record[key])


def _measure(args, label: str, log: list, gbps: dict[str, float] | None = None, **kw) -> dict:
    """Compute time and the step at two bandwidths, their runs interleaved step by step. Without ``gbps``, a
    calibration run picks them: copies of half the compute time, and of twice it."""
    shares = (("smaller", 0.5), ("larger", 2.0))
    if gbps is None:
        calib = Runner(args, INSTANT_GBPS, **kw)
        for _ in range(args.warmup + 2):
            calib.step()
        rec = calib.close()
        per_step, guess = _median(rec, "bytes"), _median(rec, "step_s")
        gbps = {name: per_step / (share * guess) / 1e9 for name, share in shares}
    names = ["compute", "compute again"] + [name for name, _ in shares]
    records = dict(zip(names, _interleaved(args, [Runner(args, INSTANT_GBPS, **kw), Runner(args, INSTANT_GBPS, **kw)]
                                                + [Runner(args, gbps[n], **kw) for n, _ in shares])))
    log.append({"label": label, **records})
    compute = _median(records["compute"], "step_s")
    again = _median(records["compute again"], "step_s")
    out = {"label": label, "compute_s": compute, "rows": [], "gbps": gbps, "noise": abs(again - compute) / compute}
    for name, _ in shares:
        rec = records[name]
        step, transfer, blocked = _median(rec, "step_s"), _median(rec, "issued_s"), _median(rec, "blocked_s")
        hidden = min(1.0, max(0.0, (compute + transfer - step) / transfer)) if transfer > 0 else 1.0
        out["rows"].append({"name": name, "gbps": gbps[name], "step_s": step, "transfer_s": transfer,
                            "hidden": hidden, "engine_hidden": max(0.0, transfer - blocked) / transfer})
    return out


def _speculation(args, log: list, gbps: float) -> list[dict]:
    """Step time with and without the speculative host update at one bandwidth, clipping never or always."""
    cases = [(name, clip, spec) for name, clip in (("never clips", 0.0), ("always clips", 1e-6))
             for spec in (False, True)]
    records = _interleaved(args, [Runner(args, gbps, speculative=spec, clip=clip) for _, clip, spec in cases])
    log.append({"speculation": [dict(zip(("clipping", "clip", "speculative"), c)) for c in cases], "gbps": gbps,
                "runs": records})
    rows = []
    for i in range(0, len(cases), 2):
        off, on = _median(records[i], "step_s"), _median(records[i + 1], "step_s")
        rows.append({"clip": cases[i][0], "off_s": off, "on_s": on, "gain": off / on - 1.0,
                     "accepted": records[i + 1]["accepted"], "steps": args.steps})
    return rows


def _table(args, results: list[dict], spec: list[dict], started: str) -> str:
    lines = [f"# bench_overlap ({'quick' if args.quick else 'full'} mode)", "",
             f"{started}; {platform.node()}: {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s); {args.layers} blocks of hidden {args.hidden} "
             f"({sum(8 * args.hidden ** 2 + 7 * args.hidden for _ in range(args.layers)) / 1e6:.2f}M parameters), "
             f"micro-batch {args.micro_batch} x seq {args.seq}, 2 micro-batches per step, fp32, DP 1, offload cpu; "
             f"emulated random delay {args.random_delay_ms} ms per copy; {args.steps} timed steps per "
             f"configuration, the configurations of a table stepped in turn (medians)", "",
             "| configuration | transfers vs compute | bandwidth (GB/s) | compute (s) | compute again: noise | "
             "transfer (s) | compute + transfer (s) | step (s) | hidden | engine: 1 - blocked/issued |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for row in res["rows"]:
            lines.append(f"| {res['label']} | {row['name']} | {row['gbps']:.3f} | {res['compute_s']:.3f} | "
                         f"{100 * res['noise']:.1f}% | {row['transfer_s']:.3f} | "
                         f"{res['compute_s'] + row['transfer_s']:.3f} | {row['step_s']:.3f} | "
                         f"{100 * row['hidden']:.0f}% | {100 * row['engine_hidden']:.0f}% |")
    gbps = results[0]["gbps"]["smaller"]
    lines += ["", f"Speculative host update at the smaller bandwidth of rate 0 ({gbps:.3f} GB/s):",
              "", "| clipping | step without (s) | step with (s) | gain | speculations accepted |",
              "|---|---:|---:|---:|---:|"]
    for row in spec:
        lines.append(f"| {row['clip']} | {row['off_s']:.3f} | {row['on_s']:.3f} | {100 * row['gain']:+.1f}% | "
                     f"{row['accepted']} sub-groups in {row['steps']} steps |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 blocks of hidden 256, 8 timed steps")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--random-delay-ms", type=float, default=0.2)
    p.add_argument("--table", default=os.path.join(RESULTS_DIR, "bench_overlap.md"))
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    quick = {"layers": 4, "hidden": 256, "steps": 8}
    full = {"layers": 8, "hidden": 384, "steps": 24}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    log: list = []
    rate0 = _measure(args, "rate 0", log)
    # rate 0.5 at the same bandwidths: half the sub-groups stay on the device, so less is copied
    results = [rate0, _measure(args, "rate 0.5 (device + host lanes)", log, gbps=rate0["gbps"], rate=0.5)]
    spec = _speculation(args, log, rate0["gbps"]["smaller"])
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
