"""Packing parameters into flat pages (chunks) and splitting each page 1/N over the data-parallel group.

A chunk is a flat buffer holding several whole parameters back to back (registration order, which for
GPT-style models is execution order), padded to a multiple of the DP size; rank r owns elements
[r*S, (r+1)*S). Parameters become views into the chunk's ``full`` buffer once, at start-up. A chunk is
*resident* when its full buffer stays allocated (stages 1 and 2, and stage-3 parameters at or below
``stage3_param_persistence_threshold``); otherwise its storage is resized to zero between uses, which
frees the memory while every view (including ones autograd saved) stays valid for the next gather.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import storage_pointer
from .host_memory import empty_mapped


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
                page_numel: int, dp_size: int, persistence_threshold: int, isolated: set[int]) -> list[ChunkPlan]:
    """Pack parameters, in order, into chunks of at most ``page_numel`` elements.

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
        c.padded = -(-c.numel // dp_size) * dp_size
        c.shard = c.padded // dp_size
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


class FlatChunk:
    """Runtime state of one chunk on this rank: the full buffer and the handles to this rank's shards."""

    def __init__(self, plan: ChunkPlan, rank: int, full: torch.Tensor):
        self.plan = plan
        self.rank = rank
        self.full = full  # compute dtype, on the device; storage empty while released (non-resident)
        self.lo, self.hi = rank * plan.shard, (rank + 1) * plan.shard
        self.segments = plan.shard_segments(rank)
        self.param_shard: torch.Tensor | None = None  # compute dtype, this rank's slice of the parameters
        self.master: torch.Tensor | None = None  # fp32 (may be the same tensor as param_shard)
        self.grad: torch.Tensor | None = None  # fp32 gradient shard, accumulated over micro-batches
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.grad_spare: torch.Tensor | None = None  # lock-free update: gradients being applied in the background
        self.pending: torch.Tensor | None = None  # lock-free update: updated parameters not yet published
        self.step: torch.Tensor | None = None  # Adam step count (float scalar, fused AdamW's convention)
        self.opt_tier = ""
        # States whose home is an SSD page file: the attributes above are None except while swapped in.
        self.swapped: list[str] = []
        self.master_in_param = False  # fp32: the parameter shard is the master (no separate copy)
        self.gathered = plan.resident
        self._mapping: torch.Tensor | None = None  # what ``full`` points at while gathered outside an arena (CPU)

    @property
    def index(self) -> int:
        return self.plan.index

    def bind_params(self) -> None:
        """Make every parameter a view of the full buffer (done once, while the storage is allocated)."""
        for s in self.plan.slots:
            s.param.data = self.full[s.offset:s.offset + s.numel].view(s.shape)

    def full_nbytes(self) -> int:
        return self.plan.padded * self.full.element_size()

    def allocate_full(self) -> None:
        """Memory for a gather outside an arena. On the CPU it is a mapping of its own (host_memory.py): a chunk
        freed between the model's tensors would otherwise leave a chunk-sized hole in their heap."""
        storage = self.full.untyped_storage()
        if storage.nbytes() != 0:
            return
        if self.full.device.type == "cpu" and storage_pointer.mechanism() is not None:
            self._mapping = empty_mapped(self.full_nbytes(), torch.uint8, self.full.device)
            storage_pointer.point(storage, self._mapping.data_ptr(), self.full_nbytes(), self.full.device)
        else:
            storage.resize_(self.full_nbytes())

    def free_full(self) -> None:
        if self._mapping is not None:
            storage_pointer.point(self.full.untyped_storage(), 0, 0, self.full.device)
            self._mapping = None
        else:
            self.full.untyped_storage().resize_(0)
        self.gathered = False

    def shard_of_full(self) -> torch.Tensor:
        return self.full[self.lo:self.hi]

    def state_key(self, name: str) -> str:
        """Store key of state ``name`` (master, exp_avg, exp_avg_sq, grad, param)."""
        return f"c{self.index}.{name}"

    def master_is_param(self) -> bool:
        return self.master_in_param

    def opt_swapped(self) -> list[str]:
        """SSD states the optimizer reads (and writes back, except a gradient shard; a bf16/fp16 parameter
        shard is only written)."""
        return [n for n in self.swapped if n != "param" or self.master_in_param]
