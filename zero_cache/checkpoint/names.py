"""Names in a checkpoint directory of the engine's per-rank layout (DeepSpeed's): every writer and reader
takes them from here.

    <save_dir>/latest                 the tag of the last complete checkpoint (written last)
    <save_dir>/global_step<N>/        a checkpoint's tag directory; any tag a caller names works the same way
"""
from __future__ import annotations

import os

LATEST = "latest"


def default_tag(global_steps: int) -> str:
    """The tag of a checkpoint saved after ``global_steps`` steps when the caller names none."""
    return f"global_step{global_steps}"


def latest_path(save_dir: str) -> str:
    """The file that names the last complete checkpoint's tag."""
    return os.path.join(save_dir, LATEST)
