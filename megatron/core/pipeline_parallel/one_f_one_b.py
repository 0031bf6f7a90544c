"""The order of PipeDream-flush 1F1B on one pipeline rank, as rounds (``interleaved.Round``).

Stage r of p runs ``w = min(p - r - 1, m)`` warm-up forwards, then m - w steady pairs of one forward and one
backward, then the w remaining backwards. A steady pair is two rounds: the forward, whose exchange sends its
output and receives the gradient of the backward that follows; the backward, whose exchange sends its input
gradient and receives the input of the next forward. That is Megatron's ``send_forward_recv_backward`` /
``send_backward_recv_forward`` pairing: the next stage's exchanges are the same two, one step behind, so each
send meets its receive. Cool-down backwards receive the next one's gradient in their own exchange.

Pure bookkeeping (``rounds.py``), like ``interleaved.py``: ``schedules.py`` runs the rounds of either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron.core.pipeline_parallel.rounds import Round


@dataclass(frozen=True)
class OneFOneBSchedule:
    """1F1B on pipeline rank ``rank`` of ``stages``, ``microbatches`` micro-batches per step, one model chunk."""
    stages: int
    rank: int
    microbatches: int
    chunks: ClassVar[int] = 1
    splits_backward: ClassVar[bool] = False

    def __post_init__(self):
        if self.stages < 2 or not 0 <= self.rank < self.stages or self.microbatches < 1:
            raise ValueError(f"1F1B needs >= 2 stages, a rank among them and >= 1 micro-batch (got {self.stages}, "
                             f"{self.rank}, {self.microbatches})")

    @property
    def total(self) -> int:
        return self.microbatches

    def chunk(self, k: int, forward: bool = True) -> int:
        return 0

    def microbatch(self, k: int) -> int:
        return k

    def is_last_backward_of_chunk(self, k: int) -> bool:
        return k == self.microbatches - 1

    def input_received(self, k: int) -> bool:
        return self.rank > 0

    def output_sent(self, k: int) -> bool:
        return self.rank < self.stages - 1

    def grad_received(self, k: int) -> bool:
        return self.rank < self.stages - 1

    def grad_sent(self, k: int) -> bool:
        return self.rank > 0

    def _recv_input(self, k: int) -> int | None:
        return 0 if k < self.total and self.input_received(k) else None

    def _recv_grad(self, k: int) -> int | None:
        return 0 if k < self.total and self.grad_received(k) else None

    def warmup(self, forward_only: bool = False) -> int:
        return self.total if forward_only else min(self.stages - self.rank - 1, self.total)

    def rounds(self, forward_only: bool = False) -> list[Round]:
        m, w = self.total, self.warmup(forward_only)
        steady = m - w
        out = [Round(recv_forward=self._recv_input(0))]
        for k in range(w):
            out.append(Round(forward=k, send_forward=self.output_sent(k), recv_forward=self._recv_input(k + 1)))
        if forward_only:
            return out
        for k in range(steady):
            f = w + k
            out.append(Round(forward=f, send_forward=self.output_sent(f), recv_backward=self._recv_grad(k)))
            # The last steady backward's exchange also brings the first cool-down backward's gradient.
            out.append(Round(backward=k, send_backward=self.grad_sent(k), recv_forward=self._recv_input(f + 1),
                             recv_backward=self._recv_grad(k + 1) if k == steady - 1 else None))
        if steady == 0:
            out.append(Round(recv_backward=self._recv_grad(0)))
        for k in range(steady, m):
            out.append(Round(backward=k, send_backward=self.grad_sent(k), recv_backward=self._recv_grad(k + 1)))
        return out
