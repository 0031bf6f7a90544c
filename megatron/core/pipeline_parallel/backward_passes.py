"""What a pipeline schedule tells the owner of the gradients about each backward pass.

The owner (the trainer's backend: Megatron's DDP, or the zero_cache engine) decides what to do with it: DDP holds
its all-reduce back until a chunk's last backward of the step, the engine takes the step's last pass for the one
whose gradients are final (it starts their statistics and the update there). A schedule that splits the backward
(zero-bubble, ``zero_bubble.py``) also asks the owner to keep each backward's weight gradients aside and to
compute them later, in a pass of their own.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol


class BackwardPasses(Protocol):
    def backward_pass(self, last_of_chunk: bool, last_of_step: bool) -> ContextManager[None]:
        """Around one backward (or weight) pass. ``last_of_chunk``: no later pass of this step reaches the model
        chunk it runs through; ``last_of_step``: no later pass of this step on this rank at all."""

    def deferred_weight_grads(self) -> ContextManager[Any]:
        """Around the input-gradient pass of a split backward; yields what ``backward_weights`` computes later."""

    def backward_weights(self, kept: Any) -> None:
        """The weight pass of a split backward: the weight gradients ``deferred_weight_grads`` kept."""


class UnownedGradients:
    """Gradients left in ``param.grad`` for the caller: nothing to hold back, and no split backward."""

    def backward_pass(self, last_of_chunk: bool, last_of_step: bool) -> ContextManager[None]:
        return contextlib.nullcontext()

    def deferred_weight_grads(self) -> ContextManager[Any]:
        raise ValueError("a split backward (zero-bubble schedule) needs an owner of the gradients that can keep "
                         "weight gradients aside: the zero_cache engine")

    def backward_weights(self, kept: Any) -> None:
        raise ValueError("a split backward needs the zero_cache engine")
