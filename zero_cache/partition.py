"""Packing parameters into flat pages (chunks) and splitting each page 1/N over the data-parallel group.

A chunk is a flat buffer holding several whole parameters back to back (registration order, which for
GPT-style models is execution order), padded to a multiple of the DP size; rank r owns elements
[r*S, (r+1)*S). A chunk is *resident* when its full buffer stays allocated (stages 1 and 2, and stage-3
parameters at or below ``stage3_param_persistence_threshold``); otherwise it is gathered for each use
(chunk.py holds a chunk's runtime state).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn


@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter
    offset: int  # first element inside the chunk
    numel: int
    shape: tuple[int, ...]


@dataclass
class ShardSegment:
    """The part of one parameter that falls in this rank's shard."""
    slot: ParamSlot
    shard_lo: int  # range inside the shard
    shard_hi: int
    param_lo: int  # first element inside the (flattened) parameter


@dataclass
class ChunkPlan:
    index: int
    group: int  # optimizer param-group index (weight decay)
    resident: bool
    slots: list[ParamSlot] = field(default_factory=list)
    numel: int = 0
    padded: int = 0
    shard: int = 0

    def shard_segments(self, rank: int) -> list[ShardSegment]:
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(ShardSegment(s, a - lo, b - lo, a - s.offset))
        return out


def plan_chunks(named_params: list[tuple[str, nn.Parameter]], group_of: dict[int, int], *, stage: int,
                page_numel: int, dp_size: int, persistence_threshold: int, isolated: set[int],
                group_dp_sizes: Sequence[int] | None = None) -> list[ChunkPlan]:
    """Pack parameters, in order, into chunks of at most ``page_numel`` elements.

    Each chunk is split over ``dp_size`` ranks, or over the size of its optimizer group's own shard group
    (``group_dp_sizes[group]``, the shard groups of builder.py).

    Chunks never mix optimizer groups or resident/partitioned parameters; parameters in ``isolated``
    (ids of tied parameters whose gradients are all-reduced across another group) get a chunk of their
    own so that every member of that group shards them identically.
    """
    chunks: list[ChunkPlan] = []
    open_chunk: dict[tuple[int, bool], ChunkPlan] = {}
    for name, p in named_params:
        resident = stage < 3 or p.numel() <= persistence_threshold
        key = (group_of[id(p)], resident)
        if id(p) in isolated:
            chunk = ChunkPlan(len(chunks), key[0], resident)
            chunks.append(chunk)
        else:
            chunk = open_chunk.get(key)
            if chunk is None or (chunk.numel and chunk.numel + p.numel() > page_numel):
                chunk = ChunkPlan(len(chunks), key[0], resident)
                chunks.append(chunk)
                open_chunk[key] = chunk
        chunk.slots.append(ParamSlot(name, p, chunk.numel, p.numel(), tuple(p.shape)))
        chunk.numel += p.numel()
    for c in chunks:
        size = dp_size if group_dp_sizes is None else group_dp_sizes[c.group]
        c.padded = -(-c.numel // size) * size
        c.shard = c.padded // size
    return chunks


def plan_sub_groups(chunks: list[ChunkPlan], sub_group_size: int) -> list[list[int]]:
    """Consecutive chunks of one optimizer group, at most ``sub_group_size`` shard elements each (>= 1 chunk)."""
    groups: list[list[int]] = []
    size = 0
    for c in chunks:
        if not groups or chunks[groups[-1][0]].group != c.group or size + c.shard > sub_group_size:
            groups.append([])
            size = 0
        groups[-1].append(c.index)
        size += c.shard
    return groups
