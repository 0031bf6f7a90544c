"""One chunk's runtime state on this rank: its full buffer, the shard group it is split over and its states.

Parameters become views into the chunk's ``full`` buffer once, at start-up. A partitioned chunk's storage is
emptied between uses, which frees the memory while every view (including ones autograd saved) stays valid for
the next gather. The shard's states (states.py) sit in typed slots: ``chunk.grad`` is the ``State.GRAD``
slot, ``chunk.tensor(state)`` any of them. A state whose home is an SSD page file (``chunk.swapped``) holds a
tensor only while it is swapped in.
"""
from __future__ import annotations

import torch

from . import storage_pointer
from .chunk_collectives import ChunkCollectives
from .host_memory import empty_mapped
from .partition import ChunkPlan
from .states import State


class _Slot:
    """A typed attribute backed by the chunk's state table."""

    def __init__(self, state: State):
        self.state = state

    def __get__(self, chunk: "FlatChunk | None", owner=None):
        return self if chunk is None else chunk.states[self.state]

    def __set__(self, chunk: "FlatChunk", tensor: torch.Tensor | None) -> None:
        chunk.states[self.state] = tensor


class FlatChunk:
    param_shard = _Slot(State.PARAM)  # compute dtype, this rank's slice of the parameters
    master = _Slot(State.MASTER)  # fp32 (the same tensor as param_shard when master_in_param)
    grad = _Slot(State.GRAD)  # fp32 gradient shard, accumulated over micro-batches
    exp_avg = _Slot(State.EXP_AVG)
    exp_avg_sq = _Slot(State.EXP_AVG_SQ)
    grad_spare = _Slot(State.GRAD_SPARE)  # lock-free update: gradients being applied in the background
    pending = _Slot(State.PENDING)  # lock-free update: updated parameters not yet published

    def __init__(self, plan: ChunkPlan, collectives: ChunkCollectives, full: torch.Tensor, grad_factor: float):
        self.plan = plan
        self.collectives = collectives  # how its gathers and reductions run (flat or hierarchical)
        self.comm = collectives.shard  # the shard group this chunk is split over
        self.grad_factor = grad_factor  # applied to the reduced gradient sum (1/N: the mean over the group)
        self.rank = self.comm.rank
        self.full = full  # compute dtype, on the device; storage empty while released (non-resident)
        self.lo, self.hi = self.rank * plan.shard, (self.rank + 1) * plan.shard
        self.segments = plan.shard_segments(self.rank)
        self.states: dict[State, torch.Tensor | None] = dict.fromkeys(
            (State.PARAM, State.MASTER, State.GRAD, State.EXP_AVG, State.EXP_AVG_SQ, State.GRAD_SPARE,
             State.PENDING))
        self.step: torch.Tensor | None = None  # Adam step count (float scalar, fused AdamW's convention)
        self.opt_tier = ""
        self.swapped: list[State] = []  # states whose home is an SSD page file
        self.master_in_param = False  # fp32: the parameter shard is the master (no separate copy)
        self.gathered = plan.resident
        self._mapping: torch.Tensor | None = None  # what ``full`` points at while gathered outside an arena (CPU)
        self.aliased = False  # ``full`` uses the parameter shard's memory (alias_full)

    @property
    def index(self) -> int:
        return self.plan.index

    # ---- states -------------------------------------------------------------------------------------------
    def home(self, state: State) -> State:
        """The slot that stores ``state``: the master lives in the parameter shard when master_in_param."""
        return State.PARAM if state is State.MASTER and self.master_in_param else state

    def tensor(self, state: State) -> torch.Tensor | None:
        return self.states[state]

    def attach(self, state: State, tensor: torch.Tensor | None) -> None:
        """Put a (swapped-in) tensor in ``state``'s slot, or None to detach it; a parameter shard that is the
        master fills both slots."""
        self.states[state] = tensor
        if state is State.PARAM and self.master_in_param:
            self.states[State.MASTER] = tensor

    def key(self, state: State) -> str:
        """The store key of ``state``."""
        return f"c{self.index}.{state.value}"

    def on_ssd(self, state: State) -> bool:
        return state in self.swapped

    def master_is_param(self) -> bool:
        return self.master_in_param

    def opt_swapped(self) -> list[State]:
        """SSD states the optimizer reads (and writes back, except a gradient shard; a bf16/fp16 parameter
        shard is only written)."""
        return [s for s in self.swapped if s is not State.PARAM or self.master_in_param]

    # ---- the full buffer ----------------------------------------------------------------------------------
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

    def alias_full(self, shard: torch.Tensor) -> None:
        """Gathered over a shard group of one rank: the shard is the whole chunk, so ``full`` uses its memory (no
        copy and no second buffer; the caller checked device, dtype and ``storage_pointer.mechanism()``)."""
        storage_pointer.point(self.full.untyped_storage(), shard.data_ptr(), self.full_nbytes(), self.full.device)
        self.aliased = True

    def free_full(self) -> None:
        if self._mapping is not None or self.aliased:
            storage_pointer.point(self.full.untyped_storage(), 0, 0, self.full.device)
            self._mapping, self.aliased = None, False
        else:
            self.full.untyped_storage().resize_(0)
        self.gathered = False

    def shard_of_full(self) -> torch.Tensor:
        return self.full[self.lo:self.hi]
