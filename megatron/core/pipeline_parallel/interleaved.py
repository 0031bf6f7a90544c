"""The order of the interleaved 1F1B schedule (virtual pipeline stages) on one pipeline rank, as a list of rounds.

Each of the p stages holds v model chunks; chunk c of stage r is virtual stage c * p + r, so an activation goes
from stage r to stage r + 1 within a chunk, and from the last stage to stage 0's next chunk over the ring (the
gradients go the opposite way). A rank runs T = m * v virtual micro-batches per step: its k-th forward runs chunk
``(k % (p v)) // p`` on micro-batch ``(k // (p v)) * p + k % p`` (groups of p micro-batches go through the chunks
one after another), its k-th backward the same micro-batch in the reverse chunk order. Every stage runs the same
sequence, shifted by its position in the pipeline.

Warm-up runs ``(p - r - 1) * 2 + (v - 1) * p`` forwards (all of them when m == p or forward-only), then each
steady round runs one forward and one backward, and cool-down the remaining backwards. Every forward is followed
by one combined exchange with the neighbours that sends its output (unless it is the loss) and receives the input
of the next forward (unless that one embeds tokens); backwards likewise send their input gradient and receive the
next backward's output gradient. Consecutive forwards of a stage are one virtual stage apart on the sending
neighbour, so the channel from a stage to its neighbour carries the tensors in the order the receiver consumes
them, and no two neighbours wait on each other (``tests/core/test_interleaved_schedule.py`` checks both on every
rank of simulated pipelines).

This module is pure bookkeeping (no tensors, no communication; ``rounds.py``): ``schedules.py`` runs the rounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron.core.pipeline_parallel.rounds import Round


@dataclass(frozen=True)
class InterleavedSchedule:
    """The interleaved schedule of pipeline rank ``rank`` of ``stages``, with ``chunks`` model chunks per stage and
    ``microbatches`` micro-batches per step (a multiple of ``stages``)."""
    stages: int
    rank: int
    chunks: int
    microbatches: int
    splits_backward: ClassVar[bool] = False

    def __post_init__(self):
        p, v, m = self.stages, self.chunks, self.microbatches
        if p < 2 or v < 2:
            raise ValueError(f"the interleaved schedule needs >= 2 stages and >= 2 chunks per stage (got {p}, {v})")
        if not 0 <= self.rank < p:
            raise ValueError(f"pipeline rank {self.rank} is not in [0, {p})")
        if m < 1 or m % p:
            raise ValueError(f"the interleaved schedule runs micro-batches in groups of the pipeline size {p}: "
                             f"{m} micro-batches per step is not a multiple of {p}")

    @property
    def total(self) -> int:
        """Virtual micro-batches per step on this rank: every micro-batch once through every chunk."""
        return self.microbatches * self.chunks

    # ----- which chunk and micro-batch -----
    def chunk(self, k: int, forward: bool = True) -> int:
        """The model chunk of the ``k``-th forward (or backward)."""
        c = (k % (self.stages * self.chunks)) // self.stages
        return c if forward else self.chunks - 1 - c

    def microbatch(self, k: int) -> int:
        """The micro-batch of the ``k``-th forward (and of the ``k``-th backward)."""
        p = self.stages
        return (k // (p * self.chunks)) * p + k % p

    def is_last_backward_of_chunk(self, k: int) -> bool:
        """The ``k``-th backward is its chunk's last of the step (its gradients are then final)."""
        return self.microbatch(k) == self.microbatches - 1

    # ----- who talks to whom -----
    def _first(self) -> bool:
        return self.rank == 0

    def _last(self) -> bool:
        return self.rank == self.stages - 1

    def input_received(self, k: int) -> bool:
        """The ``k``-th forward takes its input from the previous stage (else it embeds tokens)."""
        return not (self._first() and self.chunk(k) == 0)

    def output_sent(self, k: int) -> bool:
        """The ``k``-th forward's output goes to the next stage (else it is the loss)."""
        return not (self._last() and self.chunk(k) == self.chunks - 1)

    def grad_received(self, k: int) -> bool:
        """The ``k``-th backward takes its output gradient from the next stage (else it starts at the loss)."""
        return not (self._last() and self.chunk(k, forward=False) == self.chunks - 1)

    def grad_sent(self, k: int) -> bool:
        """The ``k``-th backward's input gradient goes to the previous stage (else its input was tokens)."""
        return not (self._first() and self.chunk(k, forward=False) == 0)

    def _recv_input(self, k: int) -> int | None:
        """The chunk of forward ``k``'s input if it arrives from a neighbour (None past the end too)."""
        return self.chunk(k) if k < self.total and self.input_received(k) else None

    def _recv_grad(self, k: int) -> int | None:
        return self.chunk(k, forward=False) if k < self.total and self.grad_received(k) else None

    # ----- the rounds -----
    def warmup(self, forward_only: bool = False) -> int:
        """Forwards before the first backward."""
        p, v = self.stages, self.chunks
        if forward_only or self.microbatches == p:
            return self.total
        return min((p - self.rank - 1) * 2 + (v - 1) * p, self.total)

    def rounds(self, forward_only: bool = False) -> list[Round]:
        total, warmup = self.total, self.warmup(forward_only)
        steady = total - warmup
        out = [Round(recv_forward=self._recv_input(0))]
        for k in range(warmup):
            # The last warm-up exchange also brings the first backward's gradient (when a steady phase follows).
            first_grad = self._recv_grad(0) if k == warmup - 1 and steady > 0 else None
            out.append(Round(forward=k, send_forward=self.output_sent(k), recv_forward=self._recv_input(k + 1),
                             recv_backward=first_grad))
        for k in range(steady):
            f = warmup + k
            out.append(Round(forward=f, backward=k, send_forward=self.output_sent(f), send_backward=self.grad_sent(k),
                             recv_forward=self._recv_input(f + 1), recv_backward=self._recv_grad(k + 1)))
        if forward_only:
            return out
        if steady == 0:
            out.append(Round(recv_backward=self._recv_grad(0)))
        for k in range(steady, total):
            out.append(Round(backward=k, send_backward=self.grad_sent(k), recv_backward=self._recv_grad(k + 1)))
        return out
