"""Memory planner: does a GPT fit this hardware under zero_cache ZeRO-3, and where does every state live?

    python tools/plan_memory.py --size 1.3b --nproc-per-node 8 --bf16 --device cuda
    python tools/plan_memory.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --largest
    ptm-plan --size 55 --host-memory-gib 24 --nvme-free-gib 70 --json
    ptm-plan --size moe-8x1.3b --nproc-per-node 8 --expert-model-parallel-size 8 --device cuda --device-memory-gib 80
    ptm-plan --size 1.3b --bf16 --device cuda --device-memory-gib 80 --nproc-per-node 8 --tensor-model-parallel-size 2 \
        --sequence-parallel --context-parallel-size 4 --attention-dropout 0 --longest-seq --write-args args.txt
    python -m ptm_planner --size 125m --device cpu      # as examples/start.sh runs it
    ptm-plan --list-sizes                                # the sizes, their shapes and parameter counts
    ptm-plan --size 55 --profile a100-40g-hdr --bf16 --explain   # hardware from a named profile; why this config
    ptm-plan --list-profiles                             # the named GPU clusters (ptm_planner/profiles.py)

The command line, hardware detection and reports; how the plan is made is ptm_planner.plan. Exit
status: 0 fits, 3 does not fit (the message names the largest model of the family and of the start.sh
table that fit, and the hardware the request needs), 2 bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile

import torch

from megatron.core.parallel_state import ParallelConfigError, check_expert_parallel_size
from megatron.core.transformer_config import CP_COMM_TYPES, CP_COMM_TYPES_WITHOUT_DROPOUT
from megatron.training.arguments import ConfigError as MegatronConfigError
from megatron.training.arguments.model import add_model_args, model_config_from_args
from ptm_planner.activations import ActivationLayout
from ptm_planner.all_to_all import AllToAll, all_to_all
from ptm_planner.family import Plan, growth, largest, plan
from ptm_planner.hardware import DEFAULT_PROFILE, cluster_from_args, detect_hardware
from ptm_planner.longest_seq import longest_seq, seq_step
from ptm_planner.mesh_search import fastest_split
from ptm_planner.moe_args import add_expert_parallel_arg, add_moe_args, moe_megatron_args
from ptm_planner.plan import (
    DEFAULT_VOCAB_SIZE,
    OFFLOADS,
    GiB,
    Planner,
    Request,
    format_bytes,
    with_seq,
)
from ptm_planner.profiles import PROFILES, get_profile
from ptm_planner.profiles import table as profiles_table
from ptm_planner.sizes import DEFAULT_SEQ_LENGTH, SIZES, format_parameters, get_size
from ptm_planner.sizes import table as sizes_table
from ptm_planner.stages import Mesh, StageModel
from ptm_planner.step_model import StepPrediction
from zero_cache.store import DEVICE, HOST, NVME, TIERS

EXIT_FITS, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plan_memory.py", allow_abbrev=False,
        description="Plan GPU/host/SSD memory for a GPT under zero_cache ZeRO-3 (exit 0 fits, 3 does not fit).")
    p.add_argument("--size", choices=[s.name for s in SIZES], default=None,
                   help="a size of examples/start.sh (model flags given as well override it); --list-sizes shows "
                        "their shapes and parameter counts")
    p.add_argument("--list-sizes", action="store_true", help="print the sizes table and exit")
    p.add_argument("--list-profiles", action="store_true", help="print the named hardware profiles and exit")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="tokenizer vocabulary (unpadded; padded like the trainer)")
    add_model_args(p)  # Megatron's own model flags (--num-layers ... --swiglu --bf16 ...)
    add_moe_args(p)  # the trainer's mixture-of-experts flags (--num-experts --moe-router-topk ...)
    g = p.add_argument_group("mesh")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="default: the profile's GPUs per node, else the GPUs here, else 2 (as start.sh)")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    add_expert_parallel_arg(g)
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="requested micro-batch (default: the size's, else 1); lowered if it does not fit")
    g.add_argument("--recompute-activations", action="store_true",
                   help="force full activation recompute (else recommended only when needed)")
    add_long_context_args(p, g)
    g = p.add_argument_group("hardware (a flag, else --profile, else detected on this machine when it is the "
                             "machine planned for)")
    g.add_argument("--profile", choices=list(PROFILES), default=None,
                   help="a named GPU cluster (--list-profiles): every hardware and speed figure not given as a flag "
                        "comes from it, none from this machine")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--device-memory-gib", type=finite, default=None, help="accelerator memory per device")
    g.add_argument("--host-memory-gib", type=finite, default=None, help="host memory per node (default: available)")
    g.add_argument("--nvme-path", default=os.path.join(tempfile.gettempdir(), "zero_cache_nvme"))
    g.add_argument("--nvme-free-gib", type=finite, default=None, help="free disk under --nvme-path")
    g.add_argument("--cpus", type=int, default=None, help="CPU cores per node (SSD I/O threads)")
    g = p.add_argument_group("step prediction and choice by speed (--device cuda: from --profile, default the GPU "
                             f"here or {DEFAULT_PROFILE}, each overridden by its flag; a CPU plan: --measure)")
    g.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per step")
    g.add_argument("--device-tflops", type=finite, default=None,
                   help="TFLOP/s a GPU reaches on large GEMMs (benchmarks/matmul_peak.py measures it); default: the "
                        "profile's peak x its GEMM share")
    g.add_argument("--pcie-gbps", type=finite, default=None, help="host <-> GPU GB/s, each direction")
    g.add_argument("--device-adam-elems-per-s", type=finite, default=None)
    g.add_argument("--host-adam-elems-per-s", default=None,
                   help="fused Adam elements/s of one process's host cores, or 'measure' (here, 1 thread per process)")
    g.add_argument("--ssd-gbps", type=finite, default=None, help="SSD GB/s per process, reads and writes")
    g.add_argument("--measure", action="store_true",
                   help="on a CPU plan: measure this machine (GEMMs, memory, the link between ranks, host Adam, the "
                        "disk; ptm_planner/measure.py, about 10 s), predict the step and choose by speed")
    g.add_argument("--search-parallel", action="store_true",
                   help="also choose --tensor-model-parallel-size and --pipeline-model-parallel-size: every split of "
                        "the ranks is planned and the fastest predicted wins (ptm_planner/mesh_search.py)")
    g.add_argument("--explain", action="store_true",
                   help="print the chosen configuration's predicted step part by part, and the runners-up")
    g = p.add_argument_group("output")
    g.add_argument("--offload", choices=["auto", *OFFLOADS], default="auto",
                   help="restrict the plan to one offload mode (default: the fastest that fits)")
    g.add_argument("--largest", action="store_true", help="plan the largest model of this family (grow --largest-by)")
    g.add_argument("--largest-by", choices=["layers", "experts"], default="layers",
                   help="what --largest grows: --num-layers, or --num-experts of a mixture of experts")
    g.add_argument("--longest-seq", action="store_true",
                   help="plan the longest --seq-length this model trains at here (multiples of 2 x CP x TP)")
    g.add_argument("--write-ds-config", metavar="PATH", help="write the chosen zero_cache JSON config")
    g.add_argument("--write-args", metavar="PATH", help="write the planned Megatron flags, one shell word per line")
    g.add_argument("--json", action="store_true", help="machine-readable plan on stdout")
    return p


def finite(text: str) -> float:
    """argparse type of sizes and speeds: a finite number (inf and nan would plan nothing sensible)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def add_long_context_args(p: argparse.ArgumentParser, g: argparse._ArgumentGroup) -> None:
    """The trainer's flags that change the activations (Megatron-core names), where the model flags
    (add_model_args) do not bring them already; --recompute-granularity full|selective is among those."""
    have = p._option_string_actions
    flags = [
        ("--sequence-parallel", {"action": "store_true",
                                 "help": "with TP: norms, dropouts and residuals hold 1/TP of the sequence"}),
        ("--context-parallel-size", {"type": int, "default": 1,
                                     "help": "ranks that split every sequence (each holds seq / CP tokens)"}),
        ("--cp-comm-type", {"choices": list(CP_COMM_TYPES), "default": "p2p",
                            "help": "context-parallel attention: p2p ring, a2a Ulysses all-to-all, allgather "
                                    "(every rank gathers the whole sequence's keys and values)"}),
        ("--num-layers-per-virtual-pipeline-stage", {"type": int, "default": None,
                                                     "help": "the interleaved 1F1B schedule's model chunk size"}),
        ("--cpu-offloading", {"action": "store_true", "help": "move saved activations of the first layers of each "
                              "model chunk to host memory (all but its last unless --cpu-offloading-num-layers)"}),
        ("--cpu-offloading-num-layers", {"type": int, "default": None,
                                         "help": "layers per model chunk --cpu-offloading moves (implies it)"}),
    ]
    for flag, kwargs in flags:
        if flag not in have:
            g.add_argument(flag, **kwargs)


def layout_from_args(args: argparse.Namespace, mesh: Mesh) -> ActivationLayout:
    """The activation layout of the flags, checked as the trainer checks them (parse.py), so that a plan that fits
    is one the trainer takes."""
    tp, pp, cp = mesh.tp, mesh.pp, mesh.cp
    layers = args.num_layers // pp
    n = args.num_layers_per_virtual_pipeline_stage
    if n is not None and args.largest:  # --largest grows whole model chunks (family.growth)
        if n <= 0 or pp == 1:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {n} needs a positive size and "
                             "--pipeline-model-parallel-size > 1")
    elif n is not None:
        if n <= 0 or layers % n:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {n} must divide the layers per pipeline stage "
                             f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp})")
        if layers // n > 1 and pp == 1:
            raise ValueError("the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs "
                             "--pipeline-model-parallel-size > 1")
        n = n if layers // n > 1 else None
    sp = args.sequence_parallel and tp > 1
    if (cp > 1 or sp) and args.num_experts:
        what = "--context-parallel-size > 1" if cp > 1 else "--sequence-parallel"
        raise ValueError(f"{what} with mixture-of-experts layers (--num-experts) is not supported; drop one")
    if cp > 1 and mesh.ep > 1:
        raise ValueError("expert parallelism with context parallelism is not supported; use "
                         "--expert-model-parallel-size 1 or --context-parallel-size 1")
    if cp > 1 and args.cp_comm_type in CP_COMM_TYPES_WITHOUT_DROPOUT and args.attention_dropout > 0:
        raise ValueError(f"--attention-dropout {args.attention_dropout} with --cp-comm-type {args.cp_comm_type} (its "
                         "block kernels take no dropout): set --attention-dropout 0, or use --cp-comm-type a2a")
    if cp > 1 and args.cp_comm_type == "a2a" and (args.num_attention_heads // tp) % cp:
        raise ValueError(f"--cp-comm-type a2a splits each tensor-parallel rank's {args.num_attention_heads // tp} "
                         f"attention heads over --context-parallel-size {cp}: choose sizes that divide, or use p2p "
                         "or allgather")
    offloaded = 0
    if args.cpu_offloading or args.cpu_offloading_num_layers is not None:
        chunk = n or layers
        offloaded = -1 if args.cpu_offloading_num_layers is None else args.cpu_offloading_num_layers
        if not args.largest and not 1 <= (chunk - 1 if offloaded == -1 else offloaded) < chunk:
            raise ValueError(f"--cpu-offloading-num-layers {offloaded}: a model chunk has {chunk} layer(s) and the "
                             f"last one's activations are needed first by the backward, so 1 to {chunk - 1} can be "
                             "offloaded")
    if offloaded and args.recompute_granularity == "full":
        raise ValueError("--cpu-offloading with --recompute-granularity full: full recompute keeps only each layer's "
                         "input, there is nothing left to offload; choose one (selective recompute combines)")
    granularity = "selective" if args.recompute_granularity == "selective" else None
    return ActivationLayout(sp, args.cp_comm_type, n, granularity, offloaded)


def check_seq_split(seq_length: int, mesh: Mesh, layout: ActivationLayout) -> None:
    """Context parallelism cuts every sequence into 2 x CP chunks, sequence parallelism a rank's part into TP."""
    pieces = seq_step(mesh, layout, strict=True)
    if seq_length % pieces:
        raise ValueError(f"--seq-length {seq_length} is not divisible by {pieces} (2 x --context-parallel-size x "
                         f"--tensor-model-parallel-size with --sequence-parallel); use a multiple of {pieces}")


def request_from_args(argv: list[str]) -> tuple[Request, argparse.Namespace]:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--size", default=None)
    pre.add_argument("--largest", action="store_true")
    pre.add_argument("--longest-seq", action="store_true")
    pre.add_argument("--largest-by", default="layers")
    pre.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    pre.add_argument("--seq-length", default=None)
    pre.add_argument("--micro-batch-size", default=None)
    known, _ = pre.parse_known_args(argv)
    defaults = ["--seq-length", str(DEFAULT_SEQ_LENGTH)]
    size = None
    if known.size is not None:
        size = get_size(known.size)
        defaults += size.megatron_args()
    elif known.largest and known.largest_by == "layers":  # the layer count is what --largest finds
        defaults += ["--num-layers", str(max(1, known.pipeline_model_parallel_size))]
    elif "-h" not in argv and "--help" not in argv and "--num-layers" not in argv:
        raise ValueError("give --size NAME (see examples/start.sh list) or the model shape: --num-layers L "
                         "--hidden-size H --num-attention-heads A")
    args = build_parser().parse_args(defaults + argv)  # the request's own flags come last and win
    if args.micro_batch_size is None:
        args.micro_batch_size = size.micro_batch_size if size else 1
    # Where the sequence length and micro-batch came from, for the plan to say (see ``planned_at``).
    from_size = "size" if size else "default"
    args.seq_length_from = "flag" if known.seq_length is not None else from_size
    args.micro_batch_size_from = "flag" if known.micro_batch_size is not None else from_size
    for name in ("micro_batch_size", "nproc_per_node", "nnodes", "vocab_size"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {value})")
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
    if args.largest and args.longest_seq:
        raise ValueError("--largest grows the model and --longest-seq the sequence; ask for one at a time")
    if args.checkpoint_activations or args.recompute_activations:
        args.recompute_granularity = "full"
    granularity = args.recompute_granularity
    if granularity == "selective":  # carried by the activation layout; the model's config plans full only
        args.recompute_granularity = None
    if args.cpu_offloading_num_layers is not None:  # the planner's flag implies the trainer's
        args.cpu_offloading = True
    args.params_dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    args.seed = 1234  # initialisation only; no effect on memory
    hardware = detect_hardware(args)
    if args.nproc_per_node is None:
        args.nproc_per_node = get_profile(args.profile).gpus_per_node if args.profile else \
            (torch.cuda.device_count() or 1) if hardware.device == "cuda" and torch.cuda.is_available() else \
            (1 if hardware.device == "cuda" else 2)
    mesh = Mesh(args.nproc_per_node, args.nnodes, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                args.expert_model_parallel_size, args.context_parallel_size)
    try:
        if mesh.cp < 1:
            raise ValueError(f"--context-parallel-size {mesh.cp} must be >= 1")
        check_expert_parallel_size(mesh.ep, mesh.dp)  # also validates the mesh
        model = model_config_from_args(args).transformer_config(args.vocab_size, args.tensor_model_parallel_size)
    except (ParallelConfigError, MegatronConfigError) as e:
        raise ValueError(str(e)) from None
    args.recompute_granularity = granularity
    if model.num_layers % mesh.pp:
        raise ValueError(f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size "
                         f"{mesh.pp}")
    if model.moe is None and mesh.ep > 1:
        raise ValueError(f"--expert-model-parallel-size {mesh.ep} splits experts; give --num-experts (or drop it)")
    if model.moe is not None and model.moe.num_experts % mesh.ep:
        raise ValueError(f"--num-experts {model.moe.num_experts} is not divisible by --expert-model-parallel-size "
                         f"{mesh.ep}; choose an expert count that the expert-parallel ranks split evenly")
    layout = layout_from_args(args, mesh)
    if not args.longest_seq:  # else the search picks the length
        check_seq_split(model.seq_length, mesh, layout)
    offloads = OFFLOADS if args.offload == "auto" else (args.offload,)
    if args.gradient_accumulation_steps <= 0:
        raise ValueError(f"--gradient-accumulation-steps must be > 0 (got {args.gradient_accumulation_steps})")
    profile, speeds = cluster_from_args(args, hardware) or (None, None)
    return Request(model, mesh, hardware, args.micro_batch_size, offloads, args.make_vocab_size_divisible_by,
                   known.size, speeds, args.gradient_accumulation_steps, layout, profile), args


def long_context_args(r: Request, full_recompute: bool) -> list[str]:
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
    out += long_context_args(r, opt.recompute)
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
    return (f"offload={o.offload}, layout {o.layout}, micro-batch {o.micro_batch_size}, recompute "
            f"{recompute_text(r, o.recompute)}, keep gathered {'yes' if o.keep_gathered else 'no'}, "
            f"sub_group_size {o.sub_group_size}, rate {o.rate}")


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
                f"{', full recompute' if o.recompute else ''}")
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
           f"prefetch_cache_sub_group_rate {ev.option.rate}", ""]
    cols = ["tier", "params", "grads", "optimizer", "staging", "gathered", "reduce", "activations", "logits",
            "overhead", "total"]
    for st in ev.stages:
        out.append(f"pipeline stage {st.stage} ({format_parameters(st.numel)} parameters), bytes per process, GiB:")
        rows = [cols]
        ns, states = st.nonstate, st.states.by_kind_tier
        for tier in TIERS:
            vals = [states.get((k, tier), 0) for k in ("params", "grads", "optimizer")]
            staging = st.states.staging if tier == HOST else 0
            nonst = [ns.gathered, ns.reduce_buffers, ns.activations, ns.logits, ns.overhead_device] \
                if tier == DEVICE else [0, 0, ns.offloaded, 0, ns.overhead_host] if tier == HOST else [0] * 5
            total = st.need()[tier]
            rows.append([tier] + [f"{v / GiB:.3f}" for v in vals + [staging] + nonst + [total]])
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        out += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        offloaded = f", {format_bytes(ns.offloaded)} of them offloaded to host memory" if ns.offloaded else ""
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--list-sizes" in argv:
        print(sizes_table())
        return EXIT_FITS
    if "--list-profiles" in argv:
        print(profiles_table())
        return EXIT_FITS
    try:
        request, args = request_from_args(argv)
        split_lines = []
        if args.search_parallel:
            if args.largest or args.longest_seq:
                raise ValueError("--search-parallel plans the given model; ask for --largest or --longest-seq "
                                 "without it")
            ranked = fastest_split(request, args.vocab_size)
            if not ranked:
                print("plan_memory.py: no tensor x pipeline split of these ranks fits; drop --search-parallel to see "
                      "what the given split needs", file=sys.stderr)
                return EXIT_DOES_NOT_FIT
            request = ranked[0][0]
            best = ranked[0][1].step_s / ranked[0][1].tokens
            split_lines = ["splits of the ranks (--search-parallel), fastest predicted first:"] + [
                f"  TP {r.mesh.tp} PP {r.mesh.pp} DP {r.mesh.dp}: {pred.tokens_per_s:,.0f} tokens/s, "
                f"{pred.step_s / pred.tokens / best:.2f}x the chosen's time per token" for r, pred in ranked]
        found = None
        if args.largest:
            found = largest(request, args.largest_by)
            if not found:
                print(f"plan_memory.py: {nothing_fits(request, args.largest_by)}", file=sys.stderr)
                return EXIT_DOES_NOT_FIT
            request = growth(request, args.largest_by).apply(request, found)
        longest = None
        if args.longest_seq:
            longest = longest_seq(request)
            if not longest:
                print(f"plan_memory.py: {no_length_fits(request)}", file=sys.stderr)
                return EXIT_DOES_NOT_FIT
            request = with_seq(request, longest)
            args.seq_length_from = "longest-seq"
        result = plan(request, found, args.largest_by)
        result.longest_seq = longest
    except (ValueError, RuntimeError) as e:
        print(f"plan_memory.py: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if result.fits:
        try:
            if args.write_ds_config:
                with open(args.write_ds_config, "w", encoding="utf-8") as f:
                    json.dump(result.chosen.config, f, indent=2)
                    f.write("\n")
            if args.write_args:
                with open(args.write_args, "w", encoding="utf-8") as f:
                    f.write("\n".join(megatron_args(result)) + "\n")
        except OSError as e:
            print(f"plan_memory.py: error: cannot write {e.filename} ({e.strerror}); give a path in an existing, "
                  f"writable directory", file=sys.stderr)
            return EXIT_BAD_INPUT
    sources = {"seq_length": args.seq_length_from, "micro_batch_size": args.micro_batch_size_from,
               "hardware": args.hardware_sources, "explain": args.explain, "splits": split_lines}
    print(json.dumps(to_json(result, sources), indent=2) if args.json else table(result, sources))
    return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT
