"""Names in the trainer's checkpoint directory (Megatron-LM's): the trainer, its tools and the launcher take
them from here.

    <save>/latest_checkpointed_iteration.txt   the last complete iteration (written last)
    <save>/iter_0000100/                        the checkpoint of iteration 100 (any format)

``--deepspeed --ckpt-format torch`` writes the engine's per-rank layout beside them, under the engine's tag for
the iteration (``zero_cache.checkpoint.names.default_tag``: ``global_step100``).
"""
from __future__ import annotations

import os
import re

TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION_DIRNAME = re.compile(r"^iter_(\d{7})$")


def iteration_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, iteration_dirname(iteration))


def is_iteration_dirname(name: str) -> bool:
    return _ITERATION_DIRNAME.match(name) is not None


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER)
