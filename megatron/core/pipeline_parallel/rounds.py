"""A pipeline schedule as data: each rank's list of rounds, and what the loop that runs them asks of a schedule.

A schedule (1F1B in ``one_f_one_b.py``, the interleaved 1F1B in ``interleaved.py``, zero-bubble ZB-H1 in
``zero_bubble.py``) is pure bookkeeping: which forward and backward a rank runs in each round, what it exchanges
with its neighbours afterwards, and, for a schedule that splits the backward, which weight gradients it computes
while that exchange is in flight. ``schedules.py`` runs any of them with one loop, so a new schedule is a new
class, not a new branch there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# The schedules by name (--pipeline-schedule): interleaved-1f1b is the one for several model chunks per stage.
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1")


@dataclass(frozen=True)
class Round:
    """Compute, then one combined exchange with both neighbours.

    ``forward`` / ``backward``: the virtual micro-batch whose forward / backward runs first (forward before
    backward), None for none. ``send_forward``: the forward's output goes to the next stage; ``send_backward``:
    the backward's input gradient goes to the previous stage. ``recv_forward`` / ``recv_backward``: the model
    chunk whose input activation / output gradient arrives in the exchange, None for none. ``weights``: under a
    split backward, the backwards whose weight gradients are computed after the exchange is posted and before it
    is waited for (the time a rank would otherwise spend waiting for its neighbours).
    """
    forward: int | None = None
    backward: int | None = None
    send_forward: bool = False
    send_backward: bool = False
    recv_forward: int | None = None
    recv_backward: int | None = None
    weights: tuple[int, ...] = ()


class PipelineSchedule(Protocol):
    """One pipeline rank's schedule of one step. Forwards and backwards are numbered 0, 1, ... in the order
    the rank runs them (``total`` of each: every micro-batch through every model chunk)."""
    chunks: int  # model chunks on this rank
    # Backwards compute input gradients only; each one's weight gradients run in a later round's ``weights``.
    splits_backward: bool

    @property
    def total(self) -> int: ...

    def chunk(self, k: int, forward: bool = True) -> int:
        """The model chunk of the ``k``-th forward (or backward)."""

    def microbatch(self, k: int) -> int:
        """The micro-batch of the ``k``-th forward (and of the ``k``-th backward)."""

    def is_last_backward_of_chunk(self, k: int) -> bool:
        """The ``k``-th backward is its chunk's last of the step: its gradients are final, it reduces them."""

    def input_received(self, k: int) -> bool:
        """The ``k``-th forward takes its input from the previous stage (else it embeds tokens)."""

    def grad_received(self, k: int) -> bool:
        """The ``k``-th backward takes its output gradient from the next stage (else it starts at the loss)."""

    def rounds(self, forward_only: bool = False) -> list[Round]:
        """This rank's rounds, in order (every rank's together neither deadlock nor mix up tensors)."""
