"""RNG streams for dropout under tensor parallelism.

Dropout on activations that are replicated across tensor-parallel ranks must
draw the same mask on every rank (the default stream, seeded identically);
dropout on partitioned activations (attention probabilities of this rank's
heads) must draw different masks per rank (the tracker's "model-parallel"
stream). The tracker swaps the process's RNG state in and out around a region.
"""
from __future__ import annotations

import contextlib

import torch

from megatron.core import parallel_state as ps

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be forked into for a region of code."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device_type)
        _set_state(self.device_type, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call model_parallel_manual_seed() first")
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


def model_parallel_manual_seed(seed: int, device_type: str = "cpu") -> RNGStatesTracker:
    """Seed the default stream (same on all TP ranks) and return a tracker with a per-TP-rank stream."""
    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    tracker = RNGStatesTracker(device_type)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + ps.get_tensor_model_parallel_rank())
    return tracker
