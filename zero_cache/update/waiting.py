"""The waiting step: every shard is updated and written back before ``engine.step`` returns."""
from __future__ import annotations

from .base import UpdateStrategy


class WaitingUpdate(UpdateStrategy):
    def apply(self, grad_scale: float, unclipped: bool) -> int:
        self.optimizer.step(grad_scale)
        self.refresh.refresh()
        return 1
