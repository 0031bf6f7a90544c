"""Host memory outside the engine's states: glibc's malloc set for each phase, and the engine's own buffers.

glibc maps each block of at least its mmap threshold on its own and unmaps it on free; smaller blocks come
from heaps, which give memory back to the OS only from their top, once more than the trim threshold is free
there. By default both thresholds move with the program: the mmap one from 128 KiB up to 32 MiB.

- Start-up (building the chunks) allocates blocks of many sizes and lifetimes once: chunk-sized init values
  and gathers that are freed, next to shards that stay. In a heap the freed ones become holes the later
  shards do not fill, so start-up maps every block of 4 MiB and more on its own and returns it on free.
- The training loop allocates the same activations and gradients, in the same order, every micro-batch.
  Mapped on their own, each one is page-faulted in again, page by page, every time: kernel time on the cores
  the matmuls need. From the end of start-up, blocks below 128 MiB stay in the heap, which the next
  micro-batch reuses (glibc's own moving threshold stops at 32 MiB, below a 100M-parameter GPT's logits and
  embedding gradient). Larger ones are still mapped: kept in the heap too, at 1.04B parameters they held
  about 0.45 GiB more per rank for no speed-up that stood out of the noise. The heap kept for reuse also
  fragments around long-lived tensors (recomputation's saved layer inputs), so at the edge of RAM it needs
  more than a plan measured without it: ``zero_optimization.reuse_freed_host_memory`` false keeps the
  start-up setting, and the memory planner writes false (benchmarks/RESULTS.md, "Engine details").
- The engine's own chunk- and shard-sized buffers of the training loop (gathers without an arena, gradient
  reduction buffers) come from ``empty_mapped``: a mapping of their own in either phase, so one freed
  between the model's tensors never leaves a chunk-sized hole in the heap, and the memory they take is the
  memory the engine accounts.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

START_UP_MMAP_THRESHOLD = 4 << 20
TRAINING_MMAP_THRESHOLD = 128 << 20
# Some glibc releases refuse an mmap threshold above half a per-thread heap (32 MiB on 64-bit).
OLD_GLIBC_MMAP_THRESHOLD = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)


def set_malloc_for_start_up() -> int:
    """Blocks of 4 MiB and more are mapped on their own and returned to the OS on free (process-wide)."""
    return _set_thresholds(START_UP_MMAP_THRESHOLD)


def set_malloc_for_training() -> int:
    """Freed blocks below 128 MiB (32 MiB where glibc refuses more) stay in the heap for the next micro-batch
    (process-wide)."""
    return _set_thresholds(TRAINING_MMAP_THRESHOLD, OLD_GLIBC_MMAP_THRESHOLD)


def _set_thresholds(*candidates: int) -> int:
    """The first mmap threshold glibc takes; returns it, or 0 where the C library is not glibc (nothing
    changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return 0
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return 0
    for threshold in candidates:
        if mallopt(_M_MMAP_THRESHOLD, threshold):
            # Trim at twice the mmap threshold, glibc's own ratio. Set only once the mmap threshold took: a
            # trim threshold alone would freeze the mmap one at 128 KiB.
            mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
            return threshold
    return 0


def empty_mapped(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(numel)`` for an engine buffer. On the CPU a buffer of 4 MiB or more gets an anonymous
    mapping of its own, unmapped once the tensor and all its views are gone; elsewhere a plain allocation."""
    nbytes = numel * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < START_UP_MMAP_THRESHOLD:
        return torch.empty(numel, dtype=dtype, device=device)
    # Private, as glibc maps its own large blocks; the tensor keeps the mapping alive.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype, count=numel)
