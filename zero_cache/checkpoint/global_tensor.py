"""What one rank writes or reads of a mesh-independent global tensor: its chunks, each with how its values are
read (saving) or committed into their state (loading). ``distributed.py`` builds them, ``dcp_plumbing.py``
plans DCP's items from them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Chunk:
    offsets: tuple[int, ...]  # global
    sizes: tuple[int, ...]
    read: Callable[[], torch.Tensor] | None = None  # save: the chunk's values, shaped ``sizes``
    # load: commit(region offsets within the chunk, region lengths, values) writes a region into its state
    commit: Callable[[tuple[int, ...], tuple[int, ...], torch.Tensor], None] | None = None


@dataclass
class GlobalTensor:
    shape: tuple[int, ...]
    resizable_dim: int | None = None
    dtype: torch.dtype = torch.float32
    chunks: list[Chunk] = field(default_factory=list)
