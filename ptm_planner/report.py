"""What a plan says: the table ptm-plan prints, its JSON, the trainer's flags it writes (--write-args), and the
lines that say why nothing fits. How the plan is made is ptm_planner.plan; the command line is ptm_planner.cli.
"""
from __future__ import annotations

import dataclasses

from ptm_planner.all_to_all import AllToAll, all_to_all
from ptm_planner.family import Plan, growth
from ptm_planner.longest_seq import seq_step
from ptm_planner.moe_args import moe_megatron_args
from ptm_planner.plan import GiB, Planner, Request, format_bytes, with_seq
from ptm_planner.sizes import format_parameters
from ptm_planner.stages import StageModel
from ptm_planner.step_model import StepPrediction
from zero_cache.store import DEVICE, HOST, NVME, TIERS


def long_context_args(r: Request, full_recompute: bool, schedule: str = "1f1b") -> list[str]:
    """The planned activation layout as the trainer's flags (what differs from its defaults)."""
    layout, mesh, m = r.layout, r.mesh, r.model
    out = []
    if m.attention_dropout != 0.1:  # the kernel (math or flash-style) and ring attention depend on it
        out += ["--attention-dropout", f"{m.attention_dropout:g}"]
    if m.hidden_dropout != 0.1:
        out += ["--hidden-dropout", f"{m.hidden_dropout:g}"]
    if layout.granularity == "selective" and not full_recompute:
        out += ["--recompute-granularity", "selective"]
    if layout.sequence_parallel:
        out += ["--sequence-parallel"]
    if mesh.cp > 1:
        out += ["--context-parallel-size", str(mesh.cp), "--cp-comm-type", layout.cp_comm_type]
    if layout.virtual_stages(m.num_layers // mesh.pp) > 1:
        out += ["--num-layers-per-virtual-pipeline-stage", str(layout.layers_per_virtual_stage)]
    if schedule != "1f1b":
        out += ["--pipeline-schedule", schedule]
    if layout.offloaded_layers:
        out += ["--cpu-offloading"] + (["--cpu-offloading-num-layers", str(layout.offloaded_layers)]
                                       if layout.offloaded_layers > 0 else [])
    return out


def megatron_args(p: Plan) -> list[str]:
    """The planned model and batch as Megatron-LM flags (accepted by megatron/training/arguments/)."""
    m, r, opt = p.request.model, p.request, p.chosen.option
    out = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
           "--num-attention-heads", str(m.num_attention_heads), "--ffn-hidden-size", str(m.ffn_hidden_size),
           "--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.max_position_embeddings)]
    if m.num_query_groups != m.num_attention_heads:
        out += ["--num-query-groups", str(m.num_query_groups)]
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        out += ["--kv-channels", str(m.kv_channels)]
    if r.make_vocab_size_divisible_by != 128:
        out += ["--make-vocab-size-divisible-by", str(r.make_vocab_size_divisible_by)]
    if m.position_embedding_type != "learned_absolute":
        out += ["--position-embedding-type", m.position_embedding_type]
    if m.normalization != "LayerNorm":
        out += ["--normalization", m.normalization]
    out += ["--swiglu"] if m.swiglu else []
    out += ["--disable-bias-linear"] if not m.add_bias_linear else []
    out += ["--untie-embeddings-and-output-weights"] if m.untie_embeddings_and_output_weights else []
    out += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(m.precision, [])
    out += ["--micro-batch-size", str(opt.micro_batch_size)]
    if opt.recompute:
        out += ["--recompute-granularity", "full", "--recompute-method", m.recompute_method,
                "--recompute-num-layers", str(m.recompute_num_layers)]
    out += long_context_args(r, opt.recompute, opt.schedule)
    out += ["--tensor-model-parallel-size", str(r.mesh.tp), "--pipeline-model-parallel-size", str(r.mesh.pp)]
    return out + moe_megatron_args(m.moe, r.mesh.ep)


def planned_at(p: Plan, sources: dict[str, str]) -> str:
    """The sequence length and micro-batch the plan is for, and where each came from: ``sources`` maps
    seq_length / micro_batch_size to flag, size, default or longest-seq (request_from_args, main)."""
    r = p.request

    def origin(key: str, flag: str) -> str:
        return {"flag": f"given as {flag}", "size": f"size {r.size_name}'s default; give {flag} to plan another",
                "default": f"the planner's default; give {flag} to plan another",
                "longest-seq": "the longest that fits, found by --longest-seq"}[sources[key]]

    planned = p.chosen.option.micro_batch_size
    lowered = f"; lowered to {planned} to fit" if planned != r.micro_batch_size else ""
    return (f"planned at: sequence length {r.model.seq_length} ({origin('seq_length', '--seq-length')}), "
            f"micro-batch {r.micro_batch_size} ({origin('micro_batch_size', '--micro-batch-size')}{lowered})")


def describe_model(r: Request) -> str:
    m = r.model
    name = f"{r.size_name} " if r.size_name else ""
    moe = ""
    if m.moe is not None:
        e = m.moe
        moe = (f", {e.num_experts} experts top-{e.router_topk} of ffn {e.expert_ffn_hidden_size(m.ffn_hidden_size)}"
               + (f" in {sum(map(m.is_moe_layer, range(m.num_layers)))} of the layers" if e.layer_freq != 1 else "")
               + (f", shared expert ffn {e.shared_expert_intermediate_size}" if e.shared_expert_intermediate_size
                  else ""))
    active = f", {format_parameters(m.num_parameters(active=True))} active" if m.moe is not None else ""
    return (f"{name}GPT {format_parameters(m.num_parameters())} parameters{active} ({m.num_layers} layers, hidden "
            f"{m.hidden_size}, {m.num_attention_heads} heads, ffn {m.ffn_hidden_size}{moe}, seq {m.seq_length}, "
            f"vocab {m.padded_vocab_size}, {m.precision})")


def stage_all_to_all(p: Plan, stage: StageModel) -> AllToAll:
    r, opt = p.request, p.chosen.option
    return all_to_all(r.model, r.mesh.ep, opt.micro_batch_size, stage.moe_layers, r.accumulation_steps, opt.recompute)


def all_to_all_json(p: Plan, stage: StageModel) -> dict | None:
    if p.request.model.moe is None:
        return None
    traffic = stage_all_to_all(p, stage)
    return {**dataclasses.asdict(traffic), "exchange_bytes": traffic.exchange_bytes, "step_bytes": traffic.step_bytes}


def moe_lines(p: Plan) -> list[str]:
    """A mixture of experts: the parameters a rank holds and computes with, its expert states per tier, and the
    all-to-all volume of its stage (none for a dense model)."""
    r, ev = p.request, p.chosen
    m, mesh = r.model, r.mesh
    if m.moe is None:
        return []
    e = m.moe
    out = ["", f"mixture of experts: {format_parameters(m.num_parameters())} parameters, "
           f"{format_parameters(m.num_parameters(active=True))} active per token; "
           f"{e.num_experts} experts per MoE layer, {e.num_experts // mesh.ep} on each rank (EP {mesh.ep}), their "
           f"states sharded over {mesh.expert_dp} rank(s) (DP {mesh.dp} / EP {mesh.ep}); the rest over DP {mesh.dp}"]
    for st in ev.stages:
        stage, exp, traffic = st.model, st.states.expert_by_tier, stage_all_to_all(p, st.model)
        out.append(f"  pipeline stage {st.stage}: {stage.moe_layers} MoE layer(s); experts held "
                   f"{format_parameters(stage.expert_numel)} of {format_parameters(stage.numel)} parameters, "
                   f"computed with per token {format_parameters(stage.active_numel)}; expert states per process: "
                   + ", ".join(f"{t} {format_bytes(exp[t])}" for t in TIERS))
        out.append(f"    all-to-all over EP {mesh.ep}: {format_bytes(traffic.exchange_bytes)} sent per exchange "
                   f"({traffic.rows} routed rows of {m.hidden_size}, {traffic.exchanges} exchanges per MoE layer and "
                   f"micro-batch), {format_bytes(traffic.step_bytes)} per step")
    if e.capacity_factor is None and mesh.ep > 1:
        out.append("  dropless routing: activations and all-to-alls are planned for an even load; a rank whose "
                   "experts get more tokens needs more (--moe-expert-capacity-factor bounds it, and the plan)")
    return out


def to_json(p: Plan, sources: dict[str, str]) -> dict:
    ev, r = p.chosen, p.request
    opt = ev.option
    return {
        "fits": p.fits,
        "planned_at": {"seq_length": r.model.seq_length, "seq_length_from": sources["seq_length"],
                       "micro_batch_size": r.micro_batch_size, "micro_batch_size_from": sources["micro_batch_size"],
                       "text": planned_at(p, sources)},
        "model": {"num_parameters": p.num_parameters, "num_parameters_active": r.model.num_parameters(active=True),
                  **dataclasses.asdict(r.model)},
        "mesh": {**dataclasses.asdict(r.mesh), "data_parallel_size": r.mesh.dp, "world_size": r.mesh.world,
                 "expert_data_parallel_size": r.mesh.expert_dp},
        "hardware": dataclasses.asdict(r.hardware),
        "option": dataclasses.asdict(opt),
        "capacity_per_process": ev.capacity,
        "memory_budget": ev.budgets,
        "failures": ev.failures,
        "stages": [{
            "stage": st.stage, "parameters": st.numel,
            "states": {f"{k}/{t}": n for (k, t), n in sorted(st.states.by_kind_tier.items())},
            "states_by_tier": st.states.by_tier, "staging": st.states.staging, "nvme_disk": st.states.nvme_disk,
            "sub_groups": st.states.sub_groups, "sub_groups_on_device": st.states.cached_sub_groups,
            "nonstate": dataclasses.asdict(st.nonstate), "need": st.need(),
            "active_parameters": st.model.active_numel, "moe_layers": st.model.moe_layers,
            "expert_parameters": st.model.expert_numel, "expert_states_by_tier": st.states.expert_by_tier,
            "all_to_all": all_to_all_json(p, st.model),
        } for st in ev.stages],
        "ds_config": ev.config,
        "megatron_args": megatron_args(p),
        "largest_layers": p.largest_layers,
        "largest_experts": p.largest_experts,
        "largest_parameters": p.largest_parameters,
        "largest_size": p.largest_size,
        "longest_seq": p.longest_seq,
        "layout": dataclasses.asdict(r.layout),
        "needs": p.needs,
        "speeds": dataclasses.asdict(r.speeds) if r.speeds is not None else None,
        "profile": r.profile.name if r.profile is not None else None,
        "hardware_sources": sources.get("hardware", {}),
        "step_prediction": None if p.step is None else prediction_json(p.step),
        "runners_up": [{"option": dataclasses.asdict(ev.option), "step_prediction": prediction_json(pred)}
                       for pred, ev in p.runners_up],
        "message": summary(p),
    }


def prediction_json(pred: StepPrediction) -> dict:
    """A predicted step: its totals and every part in seconds (the offload lanes too, where states are away)."""
    off = pred.offload
    return {"step_s": pred.step_s, "tokens_per_s": pred.tokens_per_s, "tflops_per_gpu": pred.tflops_per_gpu,
            "mfu": pred.mfu, "expected_error": pred.expected_error, "micro_batches": pred.micro_batches,
            "bubble_micro_batches": pred.bubble_micro_batches, "micro_batch_s": pred.micro_batch_s,
            "micro_batch": {t.name: t.seconds for t in pred.micro_batch},
            "step": {t.name: t.seconds for t in pred.step},
            "offload": None if off is None else {
                **dataclasses.asdict(off), "forward_backward_s": off.forward_backward_s, "host_lane_s": off.host_lane_s,
                "optimizer_s": off.optimizer_s}}


def option_text(r: Request, o) -> str:
    schedule = f", schedule {o.schedule}" if r.mesh.pp > 1 else ""
    return (f"offload={o.offload}, layout {o.layout}, micro-batch {o.micro_batch_size}, recompute "
            f"{recompute_text(r, o.recompute)}, keep gathered {'yes' if o.keep_gathered else 'no'}, "
            f"sub_group_size {o.sub_group_size}, rate {o.rate}{schedule}")


def sources_text(sources: dict[str, str]) -> str:
    """Where each hardware and speed figure came from, grouped by origin."""
    by: dict[str, list[str]] = {}
    for name, origin in sources.items():
        by.setdefault(origin, []).append(name)
    return "; ".join(f"{origin}: {', '.join(names)}" for origin, names in by.items())


def prediction_lines(p: Plan, explain: bool) -> list[str]:
    """The chosen option's predicted step (part by part with --explain) and, with --explain, the runners-up."""
    r, pred = p.request, p.step
    if pred is None:
        return []
    pr = r.profile
    head = (f"predicted step on {pr.name} ({pr.summary}; {pr.accelerator.peak_tflops:g} TFLOP/s peak x "
            f"{pr.accelerator.gemm_efficiency:.2f} on large GEMMs), chosen as the fastest of "
            f"{len(p.runners_up) + 1 if not explain else 'the candidates that fit'} by seconds per token:")
    out = ["", head]
    if explain:
        out += pred.lines()
        if pred.offload is not None:
            out += ["  offload lanes:"] + ["  " + line for line in pred.offload.lines()[:2]]
        if p.runners_up:
            out += ["runners-up (seconds per token against the chosen):"]
            best = pred.step_s / pred.tokens
            for other, ev in p.runners_up:
                out.append(f"  {other.step_s / other.tokens / best:.2f}x: {option_text(r, ev.option)}; step "
                           f"{other.step_s * 1e3:.1f} ms, {other.tokens_per_s:,.0f} tokens/s")
    else:
        out += pred.lines()[:1] + ["  (--explain: every part, and the runners-up)"]
    return out


def summary(p: Plan) -> str:
    r = p.request
    cp = f"CP {r.mesh.cp}, " if r.mesh.cp > 1 else ""
    if p.fits:
        o = p.chosen.option
        return (f"fits: {describe_model(r)} on {r.mesh.world} processes (TP {r.mesh.tp}, {cp}PP {r.mesh.pp}, "
                f"DP {r.mesh.dp}) with offload={o.offload}, micro-batch {o.micro_batch_size}"
                f"{', full recompute' if o.recompute else ''}"
                f"{f', pipeline schedule {o.schedule}' if r.mesh.pp > 1 else ''}")
    lines = [f"does not fit: {describe_model(r)} on {r.mesh.world} processes (TP {r.mesh.tp}, {cp}PP {r.mesh.pp}, "
             f"DP {r.mesh.dp}) of this hardware:"]
    lines += [f"  - {f}" for f in p.chosen.failures]
    if p.largest_layers or p.largest_experts:
        lines.append(largest_line(p))
    elif p.largest_experts is not None:
        lines.append("no model of this family fits, not even the fewest experts")
    else:
        lines.append("no model of this family fits, not even one layer per pipeline stage")
    if p.largest_size:
        lines.append(f"the largest examples/start.sh size that fits: {p.largest_size}")
    else:
        lines.append("no examples/start.sh size fits")
    for name, need in p.needs.items():
        parts = []
        if "device_memory" in need:
            parts.append(f"{format_bytes(need['device_memory'])} per accelerator")
        parts.append(f"{format_bytes(need['host_memory'])} of host memory per node")
        if need["nvme_free"] > 0:
            parts.append(f"{format_bytes(need['nvme_free'])} free disk under {r.hardware.nvme_path}")
        lines.append(f"the requested model needs ({name}): " + ", ".join(parts))
    return "\n".join(lines)


def mesh_text(r: Request) -> str:
    """TP (sequence-parallel), CP (its attention), PP (interleaved), DP of the request."""
    m, layout = r.mesh, r.layout
    v = layout.virtual_stages(r.model.num_layers // m.pp)
    return (f"TP {m.tp}{' (sequence-parallel)' if layout.seq_split(m.tp) > 1 else ''}"
            + (f" CP {m.cp} ({layout.cp_comm_type})" if m.cp > 1 else "")
            + f" PP {m.pp}{f' ({v} model chunks each)' if v > 1 else ''} DP {m.dp}")


def recompute_text(r: Request, full: bool) -> str:
    return "full" if full else r.layout.granularity or "none"


def layout_text(r: Request, layout: str) -> str:
    """The ZeRO-3 layout across nodes and the key that sets it (docs/zero_cache/hierarchical.md)."""
    node = r.mesh.node_shard_dp
    return {"mics": f"MiCS shard groups of {node} ranks per node (mics_shard_size {node})",
            "hpz": f"secondary shards in the node (zero_hpz_partition_size {node})",
            "flat": "flat"}[layout]


def largest_line(p: Plan) -> str:
    flag, n = ("--num-layers", p.largest_layers) if p.largest_layers is not None else \
        ("--num-experts", p.largest_experts)
    return f"the largest of this family that fits: {flag} {n} ({format_parameters(p.largest_parameters)} parameters)"


def nothing_fits(r: Request, by: str = "layers") -> str:
    """One line for --largest when not even the smallest of the family (one layer per pipeline stage, or the
    fewest experts) fits: what that needs with every state on SSD against what the hardware has, and the flags
    that change either."""
    g = growth(r, by)
    what = f"{g.first} layer(s)" if by == "layers" else f"{g.first} experts per MoE layer"
    return _smallest_does_not_fit(g.apply(r, g.first), what)


def no_length_fits(r: Request) -> str:
    """One line for --longest-seq when not even the shortest length the mesh splits fits."""
    step = seq_step(r.mesh, r.layout)
    return _smallest_does_not_fit(with_seq(r, step), f"--seq-length {step} of this model")


def _smallest_does_not_fit(smallest: Request, what: str) -> str:
    r, planner = smallest, Planner(smallest)
    lean = planner.leanest()
    need = planner.requirements(dataclasses.replace(lean, offload="nvme") if "nvme" in r.offloads else lean)
    hw = r.hardware
    rows = [("host memory per node", need["host_memory"], hw.host_memory, "--host-memory-gib"),
            (f"free disk under {hw.nvme_path}", need["nvme_free"], hw.nvme_free,
             "--nvme-path (a larger disk) or --nvme-free-gib")]
    if "device_memory" in need:
        rows.append(("memory per accelerator", need["device_memory"], hw.device_memory, "--device-memory-gib"))
    short = [row for row in rows if row[1] > row[2]] or rows[:1]
    where = "detected here" if hw.detected else "given"
    return (f"nothing of this family fits: {what} ({format_parameters(smallest.model.num_parameters())} "
            f"parameters) on {r.mesh.world} processes need "
            + ", ".join(f"{format_bytes(n)} {what} ({format_bytes(have)} {where})" for what, n, have, _ in short)
            + "; plan for a machine that has it (" + ", ".join(flag for *_, flag in short)
            + ("; --profile NAME for a GPU cluster, see --list-profiles" if hw.device == "cpu" else "")
            + "), or make the model smaller (--hidden-size, --seq-length, --vocab-size) or its shards "
              "(--tensor-model-parallel-size, fewer --nproc-per-node)")


def table(p: Plan, sources: dict[str, str]) -> str:
    ev, r = p.chosen, p.request
    cpu = r.hardware.device == "cpu"
    hw = r.hardware
    out = [f"model: {describe_model(r)}", planned_at(p, sources),
           f"mesh: {r.mesh.nnodes} node(s) x {r.mesh.nproc_per_node} processes, {mesh_text(r)}",
           f"hardware: {hw.device}"
           + (f", {format_bytes(hw.device_memory)} per accelerator" if not cpu else " (the device tier is host memory)")
           + f", {format_bytes(hw.host_memory)} host memory per node, {format_bytes(hw.nvme_free)} free under "
             f"{hw.nvme_path}"
           + (f" (detected: {', '.join(hw.detected)})" if hw.detected else ""),
           f"figures from: {sources_text(sources.get('hardware', {}))}",
           f"option: offload={ev.option.offload}, layout {layout_text(r, ev.option.layout)}, "
           f"micro-batch {ev.option.micro_batch_size}, "
           f"recompute {recompute_text(r, ev.option.recompute)}, sub_group_size {ev.option.sub_group_size}, "
           f"prefetch_cache_sub_group_rate {ev.option.rate}"
           + (f", pipeline schedule {ev.option.schedule}" if r.mesh.pp > 1 else ""), ""]
    cols = ["tier", "params", "grads", "optimizer", "staging", "gathered", "reduce", "activations", "logits",
            "overhead", "total"]
    for st in ev.stages:
        out.append(f"pipeline stage {st.stage} ({format_parameters(st.numel)} parameters), bytes per process, GiB:")
        rows = [cols]
        ns, states = st.nonstate, st.states.by_kind_tier
        for tier in TIERS:
            vals = [states.get((k, tier), 0) for k in ("params", "grads", "optimizer")]
            staging = st.states.staging if tier == HOST else 0
            host = [0, 0, ns.offloaded, 0, ns.overhead_host + ns.snapshots]
            nonst = [ns.gathered, ns.reduce_buffers, ns.activations, ns.logits, ns.overhead_device] \
                if tier == DEVICE else host if tier == HOST else [0] * 5
            total = st.need()[tier]
            rows.append([tier] + [f"{v / GiB:.3f}" for v in vals + [staging] + nonst + [total]])
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        out += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        offloaded = f", {format_bytes(ns.offloaded)} of them offloaded to host memory" if ns.offloaded else ""
        if ns.snapshots:
            out.append(f"  in-memory snapshots: {format_bytes(ns.snapshots)} of host memory (in its overhead column): "
                       f"the shard's fp32 parameters and Adam moments, {r.snapshot_copies} cop"
                       f"{'ies' if r.snapshot_copies > 1 else 'y'}, twice while the next is written")
        out.append(f"  activations: {format_bytes(ns.activations_full)} with recompute {recompute_text(r, False)}, "
                   f"{format_bytes(ns.activations_recompute)} with full recompute{offloaded}; sub-groups "
                   f"{st.states.sub_groups} ({st.states.cached_sub_groups} on the device); SSD page files "
                   f"{format_bytes(st.states.nvme_disk)}")
    cap = ev.capacity
    if cpu:
        out.append(f"capacity per process: host memory (device + host tiers) {format_bytes(cap['ram'])}, "
                   f"disk {format_bytes(cap[NVME])}")
    else:
        out.append(f"capacity per process: accelerator {format_bytes(cap[DEVICE])}, host {format_bytes(cap[HOST])}, "
                   f"disk {format_bytes(cap[NVME])}")
    worst = {t: max(st.need()[t] for st in ev.stages) for t in TIERS}
    n = r.mesh.nproc_per_node
    node_ram = n * (worst[DEVICE] + worst[HOST] if cpu else worst[HOST])
    out.append(f"per node ({n} process{'es' if n > 1 else ''}): host memory {format_bytes(node_ram)} of "
               f"{format_bytes(hw.host_memory)}, "
               f"disk {format_bytes(n * worst[NVME])} of {format_bytes(hw.nvme_free)}")
    z = ev.config["zero_optimization"]
    out += ["", "recommendation:",
            f"  offload: {ev.option.offload}; layout: {layout_text(r, ev.option.layout)}; micro-batch "
            f"{ev.option.micro_batch_size} (requested {r.micro_batch_size}); recompute: "
            f"{recompute_text(r, ev.option.recompute)}",
            f"  prefetch_cache_sub_group_rate {z['prefetch_cache_sub_group_rate']}, max_contigous_params_size "
            f"{z['max_contigous_params_size']}, sub_group_size {z['sub_group_size']}, allgather_bucket_size "
            f"{z['allgather_bucket_size']}, stage3_prefetch_bucket_size {z['stage3_prefetch_bucket_size']}, "
            f"stage3_max_live_parameters {z['stage3_max_live_parameters']}"]
    if (p.largest_layers is not None or p.largest_experts is not None) and p.fits:
        out.append(f"  {largest_line(p)}")
    if p.longest_seq:
        out.append(f"  the longest sequence that fits: --seq-length {p.longest_seq} (the next multiple of "
                   f"{seq_step(r.mesh, r.layout)} does not)")
    out += moe_lines(p)
    out += prediction_lines(p, sources.get("explain", False))
    if sources.get("splits"):
        out += [""] + sources["splits"]
    out += ["", summary(p)]
    return "\n".join(out)
