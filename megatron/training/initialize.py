"""Process start-up: torch.distributed, the parallel mesh and the random seeds."""
from __future__ import annotations

import datetime
import logging
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import RNGStatesTracker, model_parallel_manual_seed
from megatron.training.config import ParallelConfig


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def initialize_distributed(parallel: ParallelConfig) -> torch.device:
    """Join the job (torchrun's env, or a one-process job when run directly) and build the mesh."""
    backend = parallel.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", _free_port())
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs CUDA; use --distributed-backend gloo on CPU")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    ps.initialize_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                 timeout=timeout, expert_model_parallel_size=parallel.expert_model_parallel_size,
                                 context_parallel_size=parallel.context_parallel_size)
    _configure_logging()
    return device


def _configure_logging() -> None:
    """Library INFO lines (the ZeRO engine's per-tier memory and SSD traffic) from the logging rank only,
    the one that prints the iteration lines; warnings from every rank. Left alone if the user configured it."""
    if logging.getLogger().handlers:
        return
    last = dist.get_rank() == dist.get_world_size() - 1
    logging.basicConfig(level=logging.INFO if last else logging.WARNING, format="[%(name)s] %(message)s")


def set_random_seed(seed: int, device: torch.device) -> RNGStatesTracker:
    """Same seed within a stage (so replicated dropout agrees across TP ranks), offset per pipeline stage."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    return model_parallel_manual_seed(seed, device.type)
