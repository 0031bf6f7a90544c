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

The command line; how the plan is made is ptm_planner.plan, what it prints and writes ptm_planner.report. Exit
status: 0 fits, 3 does not fit (the message names the largest model of the family and of the start.sh
table that fit, and the hardware the request needs), 2 bad input.
"""
from __future__ import annotations

import argparse
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
from ptm_planner.family import growth, largest, plan
from ptm_planner.hardware import DEFAULT_PROFILE, cluster_from_args, detect_hardware
from ptm_planner.longest_seq import longest_seq, seq_step
from ptm_planner.mesh_search import fastest_split
from ptm_planner.moe_args import add_expert_parallel_arg, add_moe_args
from ptm_planner.plan import DEFAULT_VOCAB_SIZE, OFFLOADS, Request, with_seq
from ptm_planner.profiles import PROFILES, get_profile
from ptm_planner.profiles import table as profiles_table
from ptm_planner.report import megatron_args, no_length_fits, nothing_fits, table, to_json
from ptm_planner.sizes import DEFAULT_SEQ_LENGTH, SIZES, get_size
from ptm_planner.sizes import table as sizes_table
from ptm_planner.stages import Mesh

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
    g = p.add_argument_group("in-memory snapshots (the trainer's flags)")
    g.add_argument("--non-persistent-ckpt-type", choices=["local"], default=None,
                   help="count the snapshots each rank keeps in host memory")
    g.add_argument("--replication", action="store_true", help="... and the copy it keeps of a peer's")
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
        ("--pipeline-schedule", {"choices": ["1f1b", "zb-h1"], "default": None,
                                 "help": "with one model chunk per stage: zb-h1 splits each backward and computes the "
                                         "weight gradients where 1F1B waits (bubble and memory as the trainer's); "
                                         "default: both are planned and the fastest that fits wins"}),
        ("--enable-zero-bubble", {"action": "store_true", "help": "--pipeline-schedule zb-h1"}),
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
    schedule = "zb-h1" if args.enable_zero_bubble else args.pipeline_schedule
    if schedule == "zb-h1" and ((pp == 1 and not args.search_parallel) or n is not None):
        raise ValueError("--pipeline-schedule zb-h1 (--enable-zero-bubble) needs --pipeline-model-parallel-size > 1 "
                         "(or --search-parallel) and one model chunk per stage (no "
                         "--num-layers-per-virtual-pipeline-stage)")
    return ActivationLayout(sp, args.cp_comm_type, n, granularity, offloaded, schedule)


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
    copies = 0 if args.non_persistent_ckpt_type is None else 2 if args.replication else 1
    return Request(model, mesh, hardware, args.micro_batch_size, offloads, args.make_vocab_size_divisible_by,
                   known.size, speeds, args.gradient_accumulation_steps, layout, profile, copies), args


def _chunks(r: Request) -> str:
    v = r.layout.virtual_stages(r.model.num_layers // r.mesh.pp)
    return f" ({v} model chunks each)" if v > 1 else ""


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
                f"  TP {r.mesh.tp} PP {r.mesh.pp}{_chunks(r)} DP {r.mesh.dp}: {pred.tokens_per_s:,.0f} tokens/s, "
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
