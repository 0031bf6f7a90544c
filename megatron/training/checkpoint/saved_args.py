"""The ``args`` a checkpoint was saved with, read in one process before anything starts (``--use-checkpoint-args``).

Reads the iteration the tracker under ``--load`` names, in the distributed format or Megatron's ``mp_rank_*``
layout (rank 0's file); the engine's own per-rank layout (``--deepspeed --ckpt-format torch``) keeps them
where this does not look, which is an error naming the way out.
"""
from __future__ import annotations

import os
from typing import Any

from megatron.training.checkpoint import legacy, names
from megatron.training.checkpoint.checkpointer import read_tracker
from zero_cache.checkpoint import CheckpointError, distributed


def saved_args(load: str) -> dict[str, Any] | None:
    """The args of the latest checkpoint under ``load``; None when there is no checkpoint there."""
    iteration = read_tracker(load) if os.path.isdir(load) else None
    if iteration is None:
        return None
    directory = names.iteration_dir(load, iteration)
    if distributed.is_started(directory):
        return distributed.load_objects(directory, ["args"])["args"]
    if not os.path.isdir(directory):
        raise CheckpointError(f"--use-checkpoint-args: iteration {iteration} under --load {load} is in the zero_cache "
                              "engine's per-rank layout, whose arguments this flag does not read; pass the model "
                              "flags instead")
    _, pp = legacy.saved_mesh(load, iteration)
    state = legacy.load_file(legacy.checkpoint_file(load, iteration, 0, 0, pp), mmap=True)
    if "args" not in state:
        raise CheckpointError(f"--use-checkpoint-args: {directory} holds no 'args'; pass the model flags instead")
    return dict(state["args"])
