"""Index arrays cached as ``.npy``: built once on global rank 0, memory-mapped by every rank.

Files are named by the MD5 of a description of everything the arrays depend on, so a changed config
(or data) gets new files and an unchanged one reuses them. Each file is written under a temporary name
and renamed; the ``.dsc`` description is written last and marks the set complete.
While rank 0 builds, the other ranks wait in one collective bounded by a timeout; rank 0 reports in it
whether building succeeded, so a failure there stops every rank instead of hanging them.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron.data.errors import OtherRankDataError
from megatron.data.utils import global_rank, log_rank0

BUILT_OK, BUILD_FAILED = 1, 2  # rank 0's outcome; the other ranks contribute 0 to the sum


@dataclass(frozen=True)
class CachedIndices:
    arrays: dict[str, np.ndarray]
    directory: str
    built: bool  # True when this call built them (on this rank), False when they were loaded


def _paths(directory: str, stem: str, names: tuple[str, ...]) -> dict[str, str]:
    paths = {name: os.path.join(directory, f"{stem}_{name}.npy") for name in names}
    paths["dsc"] = os.path.join(directory, f"{stem}.dsc")
    return paths


def _complete(paths: dict[str, str]) -> bool:
    return all(os.path.isfile(p) for p in paths.values())


def _save(paths: dict[str, str], arrays: dict[str, np.ndarray], description: str) -> None:
    os.makedirs(os.path.dirname(paths["dsc"]), exist_ok=True)
    tmp_suffix = f".tmp-{os.getpid()}"
    for name, array in arrays.items():
        with open(paths[name] + tmp_suffix, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(paths[name] + tmp_suffix, paths[name])
    with open(paths["dsc"] + tmp_suffix, "w", encoding="utf-8") as f:
        f.write(description)
    os.replace(paths["dsc"] + tmp_suffix, paths["dsc"])


def _rank0_outcome(status: int, choice: int, timeout_minutes: float) -> tuple[int, int]:
    """Share rank 0's (status, directory choice) with every rank; the wait is bounded by the timeout."""
    if not (dist.is_available() and dist.is_initialized()):
        return status, choice
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([status, choice] if dist.get_rank() == 0 else [0, 0], dtype=torch.int64, device=device)
    work = dist.all_reduce(mine, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(minutes=timeout_minutes))
    except RuntimeError as e:
        raise TimeoutError(f"rank {dist.get_rank()}: rank 0 did not finish building the data index cache within "
                           f"{timeout_minutes} min (--distributed-timeout-minutes); see rank 0's log") from e
    return int(mine[0]), int(mine[1])


def load_or_build(description: str, stem_prefix: str, names: tuple[str, ...], cache_dirs: list[str],
                  build: Callable[[], dict[str, np.ndarray]], timeout_minutes: float) -> CachedIndices:
    """The arrays ``build`` returns, from the first of ``cache_dirs`` that holds them, else built into the last.

    Rank 0 decides: it looks in ``cache_dirs`` and builds into the last one when none is complete; every
    rank then memory-maps the files from the directory rank 0 chose.
    """
    stem = f"{stem_prefix}{hashlib.md5(description.encode('utf-8')).hexdigest()}"
    rank = global_rank()
    status, choice, built = BUILT_OK, len(cache_dirs) - 1, False
    if rank == 0:
        found = [i for i, d in enumerate(cache_dirs) if _complete(_paths(d, stem, names))]
        if found:
            choice = found[0]
        else:
            try:
                start = time.perf_counter()
                arrays = build()
                _save(_paths(cache_dirs[choice], stem, names), arrays, description)
                built = True
                log_rank0(f" > built {', '.join(names)} in {time.perf_counter() - start:.2f}s -> "
                          f"{os.path.join(cache_dirs[choice], stem)}_*.npy")
            except BaseException:
                with contextlib.suppress(Exception):  # tell the waiting ranks; the build error is the one to see
                    _rank0_outcome(BUILD_FAILED, choice, timeout_minutes)
                raise
    status, choice = _rank0_outcome(status, choice, timeout_minutes)
    if status != BUILT_OK:
        raise OtherRankDataError(f"rank {rank}: rank 0 failed to build the data index cache (see its error)")
    paths = _paths(cache_dirs[choice], stem, names)
    if not _complete(paths):
        raise FileNotFoundError(f"rank {rank}: index cache {paths['dsc']} written by rank 0 is not visible here; "
                                f"--data-cache-path must be a directory every rank can read")
    arrays = {name: np.load(paths[name], mmap_mode="r", allow_pickle=False) for name in names}
    return CachedIndices(arrays=arrays, directory=cache_dirs[choice], built=built)
