"""Parallelism flags and the world size -> ``ParallelConfig``."""
from __future__ import annotations

import argparse

from megatron.core.parallel_state import mesh_sizes
from megatron.training.config import ParallelConfig


def add_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    return parser


def parallel_config_from_args(args: argparse.Namespace, world_size: int) -> ParallelConfig:
    """The data-parallel size is what the world leaves after tensor x pipeline; the global batch defaults
    to one micro-batch per data-parallel rank."""
    dp = mesh_sizes(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    global_batch_size = args.global_batch_size if args.global_batch_size is not None else args.micro_batch_size * dp
    return ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, data_parallel_size=dp,
        micro_batch_size=args.micro_batch_size, global_batch_size=global_batch_size,
        distributed_backend=args.distributed_backend, distributed_timeout_minutes=args.distributed_timeout_minutes)
