"""Keep host memory near what the engine accounts: large freed blocks go back to the OS.

glibc serves big allocations from per-thread heaps once its dynamic mmap threshold has grown, and a heap
cannot shrink below a block still in use, so chunk-sized buffers freed by one thread (gathers, init
values, staging) stay resident as fragmentation: measured here, +4 MB of RSS per 4 MB chunk built with
gloo threads active. Fixing the threshold makes every block of at least ``MMAP_THRESHOLD`` bytes its own
mapping, returned on free; smaller ones (most activations) keep the fast heap path.
"""
from __future__ import annotations

import ctypes
import ctypes.util

MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)


def return_large_frees_to_os(threshold: int = MMAP_THRESHOLD) -> bool:
    """Set glibc's mmap threshold (process-wide); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
