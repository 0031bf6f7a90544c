"""The speculative update (``speculative_update``, speculation.py): host sub-groups are updated during the
backward as their gradients become final, and the step keeps them when it would have run the same kernel on
the same values (no overflow, no clipping, the same learning rate); the others are restored and updated as
in the waiting step."""
from __future__ import annotations

from ..optimizer import ShardedAdam
from ..param_refresh import ParamRefresh
from ..speculation import Speculation, SpeculationStats
from .base import UpdateStrategy


class SpeculativeUpdate(UpdateStrategy):
    def __init__(self, optimizer: ShardedAdam, refresh: ParamRefresh, speculation: Speculation):
        super().__init__(optimizer, refresh)
        self.speculation = speculation

    def apply(self, grad_scale: float, unclipped: bool) -> int:
        accepted = self.speculation.settle(unclipped, self.optimizer.lr)
        self.optimizer.step(grad_scale, skip=accepted)
        self.refresh.refresh()
        return 1

    def skip(self) -> None:
        self.speculation.settle(False, self.optimizer.lr)
        super().skip()

    def take_speculation_stats(self) -> SpeculationStats:
        return self.speculation.take_stats()

    # ---- the lifecycle: speculate as gradients become final, revoke before a chunk is read -----------------
    def grad_final(self, chunk: int) -> None:
        self.speculation.chunk_final(chunk)

    def grad_changing(self, chunk: int) -> None:
        self.speculation.chunk_changing(chunk)

    def grad_sent(self, chunk: int) -> None:
        self.speculation.final_sent(chunk)

    def before_gather(self, chunk: int) -> None:
        self.speculation.revoke(chunk)
