"""What the checkpoint code needs from whoever owns the model states: the declared interface.

Two implementations exist: the engine's ``ShardStates`` (states sharded over the data-parallel group, in any
tier) and the trainer's plain data-parallel backend (every rank holds whole parameters and torch's AdamW
state). The checkpoint code reads and writes states only through these methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Protocol

import torch

from ..aio import BufferPool
from ..partition import ChunkPlan

# The per-element states a checkpoint holds: fp32 parameter values (the optimizer's master copy) and
# Adam's two moments.
PARAM, EXP_AVG, EXP_AVG_SQ = "param", "exp_avg", "exp_avg_sq"
STATES = (PARAM, EXP_AVG, EXP_AVG_SQ)


@dataclass(frozen=True)
class StatePiece:
    """A flat element range [lo, hi) of one parameter whose states this rank holds.

    name: the parameter's name in the module; shape: its (local) shape; handle: the owner's own reference
    (passed back to ``read_state`` / ``write_state``)."""
    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    handle: Hashable = None


class StateSource(Protocol):
    """Model states as pieces of parameters, wherever they live (device, host memory or SSD)."""

    def state_pieces(self) -> list[StatePiece]:
        """Every piece of every trainable parameter this rank holds (pieces of one parameter do not overlap)."""

    def read_state(self, piece: StatePiece, state: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) (parameter-flat, within the piece) of ``state`` (one of ``STATES``), fp32, flat.

        A view of the live tensor where the state is in memory, a new host tensor where it is read from SSD."""

    def write_state(self, piece: StatePiece, state: str, lo: int, values: torch.Tensor) -> None:
        """Copy ``values`` (flat) into elements [lo, lo + values.numel()) of ``state``; done on return."""

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors every data-parallel rank holds whole and that are not trained (persistent buffers, frozen
        parameters), by name; loading copies into them in place."""

    def training_state(self) -> dict[str, Any]:
        """Plain values that continue a run: ``optimizer_step`` (Adam's step count), ``loss_scaler`` (None
        without fp16; else ``{"scale", "growth_tracker", "hysteresis_tracker"}``) and any owner-specific
        extras. Equal on every data-parallel rank."""

    def load_training_state(self, state: dict[str, Any], load_optimizer: bool) -> None:
        """Restore ``training_state``; with ``load_optimizer`` False only what is not optimizer state."""

    def states_loaded(self) -> None:
        """Every state was written: refresh what is derived from them (compute copies, gathered parameters)."""


class ShardedStateSource(StateSource, Protocol):
    """The ZeRO engine's own layout, for the per-rank checkpoint files (``sharded.py``): flat chunks, each split
    1/N over the data-parallel group; a rank's shard of a chunk is elements [0, plan.shard) of its states."""

    dp_rank: int
    dp_size: int
    mp_rank: int  # rank in the model-parallel (tensor x pipeline) group: which part of the model
    compute_dtype: torch.dtype
    transfer_pool: BufferPool  # accounted host buffers that slices and SSD pieces move through

    def chunk_plans(self) -> list[ChunkPlan]:
        """The chunk layout (the same on every data-parallel rank)."""

    def param_aliases(self) -> dict[str, list[str]]:
        """Every module name of each managed parameter (tied parameters have several), by its slot name."""

    def chunk_state(self, chunk: int, state: str, lo: int = 0, hi: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [lo, hi) of this rank's shard of ``state`` of chunk ``chunk`` (into ``out`` when given)."""

    def set_chunk_state(self, chunk: int, state: str, values: torch.Tensor, lo: int = 0) -> None:
        """Copy ``values`` into elements [lo, lo + values.numel()) of this rank's shard of ``state``."""

    def slice_numel(self) -> int | None:
        """Elements per slice file, or None to keep each state of the rank in one tensor."""
