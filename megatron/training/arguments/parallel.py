"""Parallelism and batch flags and the world size -> ``ParallelConfig``."""
from __future__ import annotations

import argparse

from megatron.core.parallel_state import mesh_sizes
from megatron.core.pipeline_parallel.rounds import SCHEDULES
from megatron.core.transformer_config import CP_COMM_TYPES
from megatron.training.batch_schedule import BatchSchedule, parse_step_schedule
from megatron.training.config import ParallelConfig


def add_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("parallelism and batch")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", "--moe-expert-parallel-size", dest="expert_model_parallel_size",
                   type=int, default=1, help="ranks that split each MoE layer's experts (inside data parallelism)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="the experts are split over the tensor-parallel ranks like the dense layers: only "
                        "--tensor-model-parallel-size is accepted")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="Megatron-DeepSpeed: no pipeline stages; checks --pipeline-model-parallel-size is 1")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that split every sequence (each holds 2 mirrored chunks of it, so causal attention "
                        "work is even); they hold the same weights and reduce gradients with the data-parallel ranks")
    g.add_argument("--cp-comm-type", choices=list(CP_COMM_TYPES), default="p2p",
                   help="context-parallel attention: p2p = ring attention (key/value blocks passed around the "
                        "ring, overlapped with compute); a2a = all-to-all between sequence and heads around "
                        "attention (DeepSpeed-Ulysses), needs heads per tensor-parallel rank divisible by CP; "
                        "allgather = every rank gathers the whole sequence's keys and values (one all-gather a "
                        "layer; CP times their memory)")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="Megatron-DeepSpeed's Ulysses sequence parallelism: --context-parallel-size N "
                        "--cp-comm-type a2a")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with tensor parallelism: the norms, dropouts and residuals hold 1/TP of the sequence "
                        "(all-gather before and reduce-scatter after the tensor-parallel regions); ignored with "
                        "--tensor-model-parallel-size 1, as Megatron does")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="the interleaved 1F1B schedule: each pipeline stage holds (layers / PP) / N model chunks "
                        "of N layers")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="the interleaved 1F1B schedule: model chunks per pipeline stage (the other way to say "
                        "--num-layers-per-virtual-pipeline-stage)")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                   help="with --pipeline-model-parallel-size > 1: 1f1b (PipeDream-flush), interleaved-1f1b (several "
                        "model chunks per stage, set by the two flags above) or zb-h1 (zero-bubble: each backward "
                        "split into input and weight gradients, the weights computed where 1F1B waits; needs the "
                        "zero_cache engine). Default: interleaved-1f1b with virtual stages, else 1f1b")
    g.add_argument("--enable-zero-bubble", action="store_true",
                   help="the zero-bubble fork's name for --pipeline-schedule zb-h1")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per step (default: --micro-batch-size x data-parallel size, or the last size of "
                        "--step-batch-size-schedule)")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="start at START samples per step and add INCREMENT evenly over SAMPLES consumed samples up to "
                        "--global-batch-size (Megatron's ramp-up)")
    g.add_argument("--step-batch-size-schedule", default=None,
                   help="\"TOKENS:SIZE ...\" (e.g. \"0:16 2.4B:320\"): the global batch size from each token count on")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long a collective may wait for its peers during start-up, the first step and "
                        "checkpoint saves and loads (default 10)")
    g.add_argument("--train-timeout-seconds", type=float, default=300.0,
                   help="how long a collective may wait for its peers once the first step has run (default 300; "
                        "0: --distributed-timeout-minutes throughout): a peer that went silent ends the round, "
                        "this rank names the collective, and the launcher restarts (docs/fault-tolerance.md)")
    return parser


def _check_unsupported(args: argparse.Namespace) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.no_pipeline_parallel and pp != 1:
        raise ValueError(f"--no-pipeline-parallel with --pipeline-model-parallel-size {pp}: drop one of them")
    if args.expert_tensor_parallel_size not in (None, tp):
        raise ValueError(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: experts are split over "
                         f"the tensor-parallel ranks like the dense layers here; use {tp} (= "
                         "--tensor-model-parallel-size) or drop it")
    if args.ds_sequence_parallel_size != 1 and args.context_parallel_size not in (1, args.ds_sequence_parallel_size):
        raise ValueError(f"--ds-sequence-parallel-size {args.ds_sequence_parallel_size} and --context-parallel-size "
                         f"{args.context_parallel_size} both split the sequence; keep one")
    if args.rampup_batch_size is not None and args.step_batch_size_schedule is not None:
        raise ValueError("--rampup-batch-size and --step-batch-size-schedule both set the batch size; keep one")


def batch_schedule_from_args(args: argparse.Namespace, data_parallel_size: int) -> BatchSchedule | None:
    """The ramp-up or step schedule (None: constant). Without --global-batch-size a step schedule ends the
    batch at its last size; with it, the two must agree (Megatron-LM refuses both together, yet its own
    GPT-3 example passes both, equal)."""
    if args.step_batch_size_schedule is not None:
        steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        final = args.global_batch_size if args.global_batch_size is not None else steps[-1][1]
        return BatchSchedule(final, steps=steps)
    if args.rampup_batch_size is not None:
        final = args.global_batch_size
        if final is None:
            final = args.micro_batch_size * data_parallel_size
        return BatchSchedule(final, rampup=tuple(args.rampup_batch_size))
    return None


def _context_parallel(args: argparse.Namespace) -> tuple[int, str]:
    """(CP size, attention's comm type); Megatron-DeepSpeed's Ulysses flag is CP with the all-to-all."""
    if args.ds_sequence_parallel_size > 1:
        return args.ds_sequence_parallel_size, "a2a"
    return args.context_parallel_size, args.cp_comm_type


def _virtual_stages(args: argparse.Namespace) -> int | None:
    """Model chunks per pipeline stage for the interleaved schedule (None: plain 1F1B)."""
    per_stage, v = args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size
    pp = args.pipeline_model_parallel_size
    if per_stage is None and v is None:
        return None
    if per_stage is not None:
        layers = args.num_layers // pp if args.num_layers else 0
        if per_stage <= 0 or not layers or layers % per_stage:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage} must divide the layers per "
                             f"pipeline stage (--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp})")
        if v is not None and v != layers // per_stage:
            raise ValueError(f"--virtual-pipeline-model-parallel-size {v} and --num-layers-per-virtual-pipeline-stage "
                             f"{per_stage} disagree ({layers} layers per stage); keep one")
        v = layers // per_stage
    if v < 1:
        raise ValueError(f"--virtual-pipeline-model-parallel-size {v} must be >= 1")
    if v > 1 and pp == 1:
        raise ValueError("the interleaved schedule (--num-layers-per-virtual-pipeline-stage / "
                         "--virtual-pipeline-model-parallel-size) needs --pipeline-model-parallel-size > 1")
    return v if v > 1 else None


def parallel_config_from_args(args: argparse.Namespace, world_size: int) -> ParallelConfig:
    """The data-parallel size is what the world leaves after tensor x context x pipeline; the global batch
    defaults to one micro-batch per data-parallel rank."""
    _check_unsupported(args)
    cp, cp_comm_type = _context_parallel(args)
    dp = mesh_sizes(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, cp)
    schedule = batch_schedule_from_args(args, dp)
    if schedule is not None:
        global_batch_size = schedule.final
    else:
        global_batch_size = args.global_batch_size if args.global_batch_size is not None else args.micro_batch_size * dp
    return ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, data_parallel_size=dp,
        micro_batch_size=args.micro_batch_size, global_batch_size=global_batch_size,
        distributed_backend=args.distributed_backend, distributed_timeout_minutes=args.distributed_timeout_minutes,
        train_timeout_seconds=args.train_timeout_seconds or None,
        batch_schedule=schedule if schedule and not schedule.constant else None,
        expert_model_parallel_size=args.expert_model_parallel_size, context_parallel_size=cp,
        cp_comm_type=cp_comm_type, sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        virtual_pipeline_model_parallel_size=_virtual_stages(args), pipeline_schedule=_pipeline_schedule(args))


def _pipeline_schedule(args: argparse.Namespace) -> str:
    chosen = args.pipeline_schedule
    if args.enable_zero_bubble:
        if chosen not in (None, "zb-h1"):
            raise ValueError(f"--enable-zero-bubble with --pipeline-schedule {chosen}: keep one")
        chosen = "zb-h1"
    if chosen is None:
        return "interleaved-1f1b" if _virtual_stages(args) else "1f1b"
    return chosen
