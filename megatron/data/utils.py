"""Small helpers shared by the dataset modules."""
from __future__ import annotations

import numpy as np
import torch.distributed as dist


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_rank0(message: str) -> None:
    """Print once per job (on global rank 0), flushed so progress shows up in job logs at once."""
    if global_rank() == 0:
        print(message, flush=True)


class PicklesMemmapsByPath:
    """Datasets holding ``np.load(..., mmap_mode='r')`` arrays pickle them as file names, not contents."""

    def __getstate__(self) -> dict:
        return {k: ("__memmap__", v.filename) if isinstance(v, np.memmap) else v for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: np.load(v[1], mmap_mode="r") if isinstance(v, tuple) and v[:1] == ("__memmap__",)
                              else v for k, v in state.items()})
