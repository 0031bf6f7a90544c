"""One preallocated buffer that gathered stage-3 chunks are carved from (``max_contigous_params_size``).

Without it, every gather allocates its chunk's full buffer and every release frees it. On a GPU that
fragments the caching allocator; on a CPU every gather maps fresh zeroed pages (a page fault per 4 KiB).
With it, gathered parameters live in one allocation made at start-up, and the coordinator decides which
chunk to evict when a gather does not fit (it knows the recorded trace).

A chunk keeps its storage object for life: parameters, and the tensors autograd saved, are views of it.
Only the memory behind the storage moves: ``storage_pointer.point`` points the storage at a region of the
buffer (a non-owning pointer), and at nothing again on eviction. The coordinator builds an arena only where
this torch can do that (``storage_pointer.mechanism()``).

Regions are placed first-fit from a free list kept sorted by offset and coalesced on removal. Every
region starts on a 256-byte boundary.
"""
from __future__ import annotations

import bisect

import torch

from . import storage_pointer
from .chunk import FlatChunk

_ALIGN_BYTES = 256


def region_numel(numel: int, element_size: int) -> int:
    """Elements a chunk of ``numel`` elements takes in an arena: rounded up to the alignment."""
    align = max(1, _ALIGN_BYTES // element_size)
    return -(-numel // align) * align


def arena_numel(numel: int, element_size: int) -> int:
    """Elements an arena of ``numel`` requested elements holds: rounded down to the alignment."""
    return numel - numel % max(1, _ALIGN_BYTES // element_size)


class ParamArena:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.align = max(1, _ALIGN_BYTES // self.elem)
        self.numel = arena_numel(numel, self.elem)
        self.buffer = torch.empty(self.numel, dtype=dtype, device=device)
        self.device = self.buffer.device
        self._free: list[tuple[int, int]] = [(0, self.numel)]  # (offset, length) in elements, sorted by offset
        self.region: dict[int, tuple[int, int]] = {}  # chunk index -> (offset, length)
        self.used = 0
        self.peak_used = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem

    def need(self, chunk: FlatChunk) -> int:
        """Elements a chunk takes in the arena (its padded size, rounded up to the alignment)."""
        return region_numel(chunk.plan.padded, self.elem)

    def place(self, chunk: FlatChunk) -> bool:
        """Point ``chunk.full`` at a free region that holds it; False (nothing changed) when none does."""
        need = self.need(chunk)
        k = next((i for i, (_, length) in enumerate(self._free) if length >= need), None)
        if k is None:
            return False
        off, length = self._free[k]
        if length == need:
            del self._free[k]
        else:
            self._free[k] = (off + need, length - need)
        self.region[chunk.index] = (off, need)
        self.used += need
        self.peak_used = max(self.peak_used, self.used)
        storage_pointer.point(chunk.full.untyped_storage(), self.buffer.data_ptr() + off * self.elem,
                              need * self.elem, self.device)
        return True

    def remove(self, chunk: FlatChunk) -> None:
        """Give the chunk's region back; its storage becomes empty (as a released plain chunk's is)."""
        off, length = self.region.pop(chunk.index)
        storage_pointer.point(chunk.full.untyped_storage(), 0, 0, self.device)
        self.used -= length
        k = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(k, (off, length))
        # Coalesce with the neighbours, right first so that index k stays valid.
        if k + 1 < len(self._free) and off + length == self._free[k + 1][0]:
            self._free[k] = (off, length + self._free.pop(k + 1)[1])
        if k > 0 and self._free[k - 1][0] + self._free[k - 1][1] == off:
            prev_off, prev_len = self._free.pop(k - 1)
            self._free[k - 1] = (prev_off, prev_len + self._free[k - 1][1])

    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)
