"""Parallelism and batch flags and the world size -> ``ParallelConfig``."""
from __future__ import annotations

import argparse

from megatron.core.parallel_state import mesh_sizes
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
                   help="1 only: context parallelism is not implemented here")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="1 only: DeepSpeed-Ulysses sequence parallelism is not implemented here")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="accepted with --tensor-model-parallel-size 1, where Megatron turns it off too; not "
                        "implemented for larger tensor-parallel sizes")
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
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    return parser


def _check_unsupported(args: argparse.Namespace) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.no_pipeline_parallel and pp != 1:
        raise ValueError(f"--no-pipeline-parallel with --pipeline-model-parallel-size {pp}: drop one of them")
    if args.expert_tensor_parallel_size not in (None, tp):
        raise ValueError(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: experts are split over "
                         f"the tensor-parallel ranks like the dense layers here; use {tp} (= "
                         "--tensor-model-parallel-size) or drop it")
    if args.context_parallel_size != 1:
        raise ValueError(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
                         "implemented here; use 1 (and tensor or pipeline parallelism to split the model)")
    if args.ds_sequence_parallel_size != 1:
        raise ValueError(f"--ds-sequence-parallel-size {args.ds_sequence_parallel_size}: DeepSpeed-Ulysses sequence "
                         "parallelism is not implemented here; use 1")
    if args.sequence_parallel and tp > 1:
        raise ValueError(f"--sequence-parallel with --tensor-model-parallel-size {tp}: sequence parallelism is not "
                         "implemented here (activations stay whole on every tensor-parallel rank); drop it, and use "
                         "--recompute-granularity full to save activation memory")
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


def parallel_config_from_args(args: argparse.Namespace, world_size: int) -> ParallelConfig:
    """The data-parallel size is what the world leaves after tensor x pipeline; the global batch defaults
    to one micro-batch per data-parallel rank."""
    _check_unsupported(args)
    dp = mesh_sizes(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
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
        batch_schedule=schedule if schedule and not schedule.constant else None,
        expert_model_parallel_size=args.expert_model_parallel_size)
