"""A mixture-of-experts GPT: ours (expert parallelism + zero_cache ZeRO-3) against DeepSpeed-MoE, and against the
dense GPT of the same active size.

    source benchmarks/peers_env.sh                   # once: DeepSpeed in its own venv (benchmarks/.venv-peers)
    python -m benchmarks.moe_vs_peers --repeat 3     # 195M MoE (8 experts, top-2), 2 ranks on gloo, fp32
    python -m benchmarks.moe_vs_peers --preset tiny --systems ours deepspeed ddp --aux-loss-coeff 0

The systems (each its own torchrun job of benchmarks/peer_workers/worker.py, as in zero3_vs_peers.py):

- ours: our GPTModel with MoE MLPs (megatron/core/moe: top-k router, all-to-all dispatch, grouped experts),
  expert-parallel over --ep ranks, zero_cache ZeRO-3 set up as megatron/training/backends/zero.py does (dense
  parameters sharded over the data-parallel group, experts over the expert-data-parallel group);
  ``ours-offload``: parameters and optimizer states in host memory.
- deepspeed: the same GPT whose MoE MLPs are DeepSpeed's native ``deepspeed.moe.layer.MoE`` (SwiGLU experts
  like ours, the same expert-parallel split), DeepSpeed ZeRO stage 2: the highest stage DeepSpeed accepts for
  its native MoE (it refuses stage 3: peer_workers/deepspeed_moe.py says where); ``deepspeed-offload``: its
  ``offload_optimizer`` to the CPU (stage 2 has no parameter offload).
- ours-dense / deepspeed-dense: the dense GPT of the same active size (a SwiGLU MLP of top-k x the expert
  width; ours ZeRO-3, DeepSpeed ZeRO-3).
- ddp: our MoE GPT without expert parallelism (every rank holds every expert) under plain DDP: the fp32
  reference of the MoE rows' losses.

Every MoE system starts from the same weights (ours' seeded per-parameter init; DeepSpeed's router and experts
are filled from it), trains on the same batches with the same AdamW, clipping and balancing-loss coefficient;
DeepSpeed's gate is configured to route as ours (dropless, no noise, no random token selection, no Gumbel
sampling of the second expert). The one difference left is its top-2 balancing loss formula (first choices
only); with --aux-loss-coeff 0 every step's loss agrees, with a coefficient the first step's does (computed
before any update) and later ones differ by what that gradient moves. The report (header, table, losses and
balancing losses per step, notes) is printed and written to --table (default
benchmarks/results/moe_vs_peers.md); logs and per-rank results go to --run-dir (default under
benchmarks/logs/, which git ignores).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from dataclasses import dataclass

from benchmarks.peer_workers.harness import LOGS_DIR, BenchSpec, model_config
from benchmarks.zero3_vs_peers import (
    Row,
    add_report_args,
    add_run_args,
    check_run_args,
    machine_line,
    run_system,
    tokens_per_s,
    write_table,
)

PRESETS = {  # layers, hidden, heads, vocab, experts, expert ffn
    "tiny": (2, 128, 4, 1024, 8, 128),
    "200m": (8, 768, 12, 32000, 8, 1024),
}


@dataclass(frozen=True)
class System:
    key: str  # --systems name
    name: str  # table row
    impl: str  # peer_workers.worker --impl
    offload: bool
    peers_env: bool  # needs the peers' venv (DeepSpeed)
    model: str  # which spec: moe (ZeRO-3), moe-ds (ZeRO-2), moe-ddp (no expert parallelism), dense
    config: str  # the table's "parallelism, ZeRO" column


# Compared pairs run back to back, so they see similar load from other work on the machine.
SYSTEMS = [
    System("ours", "ours: MoE, zero_cache", "ours", False, False, "moe", "EP {ep}, ZeRO-3"),
    System("deepspeed", "DeepSpeed-MoE (deepspeed.moe.layer.MoE)", "deepspeed-moe", False, True, "moe-ds",
           "EP {ep}, ZeRO-2"),
    System("ours-offload", "ours: MoE, zero_cache + CPU offload", "ours", True, False, "moe",
           "EP {ep}, ZeRO-3, params + optimizer on CPU"),
    System("deepspeed-offload", "DeepSpeed-MoE + CPU offload", "deepspeed-moe", True, True, "moe-ds",
           "EP {ep}, ZeRO-2, optimizer on CPU"),
    System("ours-dense", "ours: dense, same active size", "ours", False, False, "dense", "ZeRO-3"),
    System("deepspeed-dense", "DeepSpeed: dense, same active size", "deepspeed", False, True, "dense", "ZeRO-3"),
    System("ddp", "DDP: MoE, every expert on every rank", "ddp", False, False, "moe-ddp", "EP 1, no sharding"),
]
BY_KEY = {s.key: s for s in SYSTEMS}
PEER = {"ours": "deepspeed", "ours-offload": "deepspeed-offload", "ours-dense": "deepspeed-dense"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="200m",
                   help="200m: 8 x 768, 12 heads, vocab 32000, 8 experts of SwiGLU ffn 1024 (194.7M, 81.5M active; "
                        "default); tiny: 2 x 128, vocab 1024, 8 experts of ffn 128")
    p.add_argument("--layers", type=int, help="override the preset's layers")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--vocab", type=int, help="override the preset's (padded) vocabulary size")
    p.add_argument("--experts", type=int, help="override the preset's experts per layer")
    p.add_argument("--moe-ffn", type=int, help="override the preset's expert width (SwiGLU ffn)")
    p.add_argument("--topk", type=int, default=2, help="experts per token (DeepSpeed's MoE takes 1 or 2 ... k)")
    p.add_argument("--ep", type=int, help="expert-parallel ranks (default: --nproc)")
    p.add_argument("--aux-loss-coeff", type=float, default=0.01,
                   help="balancing-loss coefficient of both systems (0: none, every step's loss must agree)")
    p.add_argument("--tokens", choices=["zipf", "uniform"], default="zipf",
                   help="the synthetic tokens' law: zipf (as zero3_vs_peers; frequent ids send many tokens to the "
                        "same experts) or uniform (routing starts near an even load)")
    add_run_args(p)
    p.add_argument("--page-size", type=int, default=500_000_000,
                   help="zero_cache chunk size in elements (allgather_bucket_size; DeepSpeed's default too)")
    add_report_args(p, list(BY_KEY), "moe_vs_peers.md")
    a = p.parse_args(argv)
    check_run_args(p, a)
    a.ep = a.ep or a.nproc
    if a.nproc % a.ep:
        p.error(f"--ep {a.ep} must divide --nproc {a.nproc}")
    return a


def make_specs(a: argparse.Namespace) -> dict[str, BenchSpec]:
    layers, hidden, heads, vocab, experts, moe_ffn = PRESETS[a.preset]
    experts, moe_ffn = a.experts or experts, a.moe_ffn or moe_ffn
    if experts % a.ep:
        raise SystemExit(f"moe_vs_peers.py: error: --experts {experts} is not divisible by --ep {a.ep}")
    moe = BenchSpec(layers=a.layers or layers, hidden=a.hidden or hidden, heads=a.heads or heads,
                    vocab=a.vocab or vocab, seq=a.seq, micro_batch=a.micro_batch, global_batch=a.global_batch,
                    steps=a.steps, warmup=a.warmup, lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
                    seed=a.seed, page_size=a.page_size, threads=a.threads, ffn_hidden=a.topk * moe_ffn, swiglu=True,
                    num_experts=experts, moe_topk=a.topk, moe_ffn_hidden=moe_ffn, moe_aux_loss_coeff=a.aux_loss_coeff,
                    expert_parallel=a.ep, token_law=a.tokens)
    return {"moe": moe, "moe-ds": dataclasses.replace(moe, zero_stage=2),
            "moe-ddp": dataclasses.replace(moe, expert_parallel=1),
            # The dense model of the same active size: one SwiGLU MLP as wide as the top-k experts together.
            "dense": dataclasses.replace(moe, num_experts=0, moe_ffn_hidden=0, moe_aux_loss_coeff=0.0,
                                         expert_parallel=1)}


def params_m(spec: BenchSpec) -> str:
    cfg = model_config(spec)
    if cfg.moe is None:
        return f"{cfg.num_parameters() / 1e6:.1f}"
    return f"{cfg.num_parameters() / 1e6:.1f} / {cfg.num_parameters(active=True) / 1e6:.1f}"


def rel(x: float, ref: float) -> float:
    return abs(x - ref) / abs(ref)


def loss_check(r: Row, ref: Row | None, rtol: float) -> str:
    """Step-1 and last-step relative difference from the reference's losses (DDP for MoE rows)."""
    if ref is None or ref is r:
        return "reference" if ref is r else "-"
    first, last = rel(r.losses[0], ref.losses[0]), rel(r.losses[-1], ref.losses[-1])
    text = f"{first:.1e} / {last:.1e}"
    if first > rtol or (last > rtol and r.system.impl != "deepspeed-moe"):
        text += f" **MISMATCH** (> {rtol:g})"
    if not r.rounds_agree(rtol):
        text += " **rounds disagree**"
    return text


def table(rows: list[Row], specs: dict[str, BenchSpec], a: argparse.Namespace) -> list[str]:
    warm = a.warmup
    ok = {r.system.key: r for r in rows if r.error is None}
    out = ["| system | parallelism, ZeRO | params total / active (M) | tokens/s | vs DeepSpeed (same offload) "
           "| median step (s) | first step (s) | peak RSS rank 0 / 1 (GiB) | step-1 loss | last-step loss "
           "| vs reference loss (step 1 / last) | load at end |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        s = r.system
        load = " / ".join(f"{o.load_end:.1f}" for o in r.rounds)
        config = s.config.format(ep=a.ep)
        params = params_m(specs[s.model])
        if r.error is not None:
            error = r.error.replace("|", "/")
            out.append(f"| {s.name} | {config} | {params} | failed: {error} | | | | | | | | {load} |")
            continue
        step = r.median_step_s(warm)
        peer = ok.get(PEER.get(s.key) or (s.key if s.peers_env else ""))
        ratio = f"{peer.median_step_s(warm) / step:.2f}x" if peer else "-"
        dense = s.model == "dense"
        ref = (ok.get("ours-dense") if s.key != "ours-dense" else r) if dense else ok.get("ddp")
        rss = " / ".join(f"{b / 2**30:.2f}" for b in r.peak_rss())
        out.append(f"| {s.name} | {config} | {params} | {tokens_per_s(step, specs[s.model]):.1f} | {ratio} "
                   f"| {step:.2f} "
                   f"| {r.first_step_s():.2f} | {rss} | {r.losses[0]:.6f} | {r.losses[-1]:.6f} "
                   f"| {loss_check(r, ref, a.loss_rtol)} | {load} |")
    lines = []
    moe, dense = ok.get("ours"), ok.get("ours-dense")
    if moe and dense:
        lines.append(f"ours, MoE over the dense model of the same active size: "
                     f"{dense.median_step_s(warm) / moe.median_step_s(warm):.2f}x the tokens/s "
                     f"({params_m(specs['moe'])}M total / active against {params_m(specs['dense'])}M)")
    for key in ("ours", "ours-offload"):
        if key in ok and PEER[key] in ok:
            lines.append(f"{key} / {PEER[key]}: {ok[PEER[key]].median_step_s(warm) / ok[key].median_step_s(warm):.2f}x "
                         "tokens/s (target >= 1.3x)")
    return out + ([""] + lines if lines else [])


def per_step(rows: list[Row]) -> list[str]:
    """Every system's loss, balancing loss (x its coefficient, rank 0's mean over layers and micro-batches) and
    routing figures at every step (round 1)."""
    out = []
    for r in rows:
        if r.error is not None:
            continue
        rank0 = r.rounds[0].ranks[0]
        out.append(f"  {r.system.key:<18} loss     " + " ".join(f"{x:.6f}" for x in r.losses))
        stats = rank0.get("step_stats") or []
        aux = [st.get("load_balancing_loss") for st in stats]
        if any(x is not None for x in aux):
            out.append(f"  {'':<18} bal.loss " + " ".join("-" if x is None else f"{x:.6f}" for x in aux))
        imb = [st.get("max_load_imbalance") for st in stats]
        if any(x is not None for x in imb):
            out.append(f"  {'':<18} max/mean choices per expert, most imbalanced layer "
                       + " ".join(f"{x:.2f}" for x in imb if x is not None))
        rows_ratio = [st.get("expert_rows_over_routed") for st in stats]
        if any(x is not None for x in rows_ratio):
            out.append(f"  {'':<18} expert rows computed / routed (dropless capacity, >=) "
                       + " ".join(f"{x:.2f}" for x in rows_ratio if x is not None))
    return out


def header(specs: dict[str, BenchSpec], a: argparse.Namespace) -> list[str]:
    moe = specs["moe"]
    cfg = model_config(moe)
    return [
        f"MoE GPT {cfg.num_parameters() / 1e6:.1f}M params, {cfg.num_parameters(active=True) / 1e6:.1f}M active "
        f"({moe.layers} layers, hidden {moe.hidden}, {moe.heads} heads, vocab {moe.vocab}, tied embeddings, LayerNorm, "
        f"learned positions; every MLP {moe.num_experts} experts top-{moe.moe_topk} of SwiGLU ffn "
        f"{moe.moe_ffn_hidden}, "
        f"bias-free; balancing loss coefficient {moe.moe_aux_loss_coeff:g}, dropless); dense: SwiGLU ffn "
        f"{specs['dense'].ffn_hidden} with biases, {model_config(specs['dense']).num_parameters() / 1e6:.1f}M",
        f"seq {moe.seq}, micro-batch {moe.micro_batch}, global batch {moe.global_batch} ({a.nproc} ranks x "
        f"{moe.micro_batch} x {moe.grad_accumulation(a.nproc)} accumulation), {moe.token_law} synthetic tokens, "
        f"fp32, gloo; {moe.warmup} warm-up + "
        f"{moe.steps} timed steps; AdamW lr {moe.lr}, wd {moe.weight_decay}, clip {moe.clip_grad}; zero_cache page "
        f"{moe.page_size:.3g} elements; {a.repeat} round(s)",
        machine_line(moe.threads, a.peers_python),
    ]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    specs = make_specs(a)
    try:
        lines = header(specs, a)
    except ValueError as e:  # a model shape the GPT cannot take, caught before any job starts
        raise SystemExit(f"moe_vs_peers.py: error: {e}") from None
    run_dir = a.run_dir or os.path.join(LOGS_DIR, f"moe_vs_peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(run_dir, exist_ok=True)
    spec_paths = {}
    for name, spec in specs.items():
        spec_paths[name] = os.path.join(run_dir, f"spec_{name}.json")
        spec.save(spec_paths[name])
    print("\n".join(lines) + f"\nlogs: {run_dir}", flush=True)
    rows = [Row(BY_KEY[k], []) for k in a.systems]
    jobs, started = len(rows) * a.repeat, time.perf_counter()
    for n in range(jobs):
        row, round_index = rows[n % len(rows)], n // len(rows)
        tag = f"[{n + 1}/{jobs}]" + (f" round {round_index + 1}" if a.repeat > 1 else "")
        print(f"{tag} {row.system.name} ...", flush=True)
        model = row.system.model
        o = run_system(row.system, spec_paths[model], specs[model], a, run_dir, round_index)
        row.rounds.append(o)
        state = f"failed: {o.error}" if o.error else \
            f"{tokens_per_s(statistics.median(o.timed_step_s(a.warmup)), specs[model]):.1f} tokens/s"
        elapsed = time.perf_counter() - started
        print(f"{tag} {row.system.name}: {state} ({o.wall_s:.0f} s wall; ETA of the run "
              f"{elapsed / (n + 1) * (jobs - n - 1):.0f} s)", flush=True)
    out = table(rows, specs, a)
    notes = [f"  {r.system.key} round {i + 1}: {o.note}" for r in rows for i, o in enumerate(r.rounds) if o.note]
    steps = per_step(rows)
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(out))
    if notes:
        print("\nnotes:\n" + "\n".join(notes))
    print("\nper step (round 1):\n" + "\n".join(steps))
    if a.table:
        write_table(a.table, argv, lines, out, notes, steps, script="moe_vs_peers",
                    steps_title="Per step (round 1): loss (global batch mean), balancing loss x coefficient (rank 0), "
                                "routing:")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"specs": {k: dataclasses.asdict(v) for k, v in specs.items()}, "header": lines, "table": out,
                       "results": [{"system": r.system.key, "round": i + 1, "error": o.error, "note": o.note,
                                    "wall_s": o.wall_s, "load_end": o.load_end, "ranks": o.ranks}
                                   for r in rows for i, o in enumerate(r.rounds)]}, f, indent=1)


if __name__ == "__main__":
    main()
