"""The lock-free update (``lock_free_update``): step t's update runs on a thread while step t+1 computes.

Step t swaps its gradient shards into ``grad_spare`` and starts the update, which writes the new parameters
into ``pending``; step t+1 publishes them (the parameter shards take ``pending``) before it starts its own. So
each forward runs on parameters one update behind (DeepSpeed's and Angel-PTM's lock-free update).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..chunk import FlatChunk
from ..optimizer import ShardedAdam
from ..param_refresh import ParamRefresh
from ..states import State
from ..store import ShardStore
from .base import UpdateStrategy


class DelayedUpdate(UpdateStrategy):
    def __init__(self, optimizer: ShardedAdam, refresh: ParamRefresh, chunks: list[FlatChunk], store: ShardStore):
        super().__init__(optimizer, refresh)
        self.chunks = chunks
        self.store = store
        self._thread = ThreadPoolExecutor(1, "zero_cache_update")
        self._pending: Future | None = None

    def backward_started(self) -> None:
        pass  # the update in flight reads the SSD states itself

    def prepare(self) -> None:
        pass

    def apply(self, grad_scale: float, unclipped: bool) -> int:
        refreshes = int(self._pending is not None)  # publish gathers only then
        self.publish()  # step t-1's update becomes visible to step t+1
        for c in self.chunks:  # step t's gradients are applied in the background
            c.grad, c.grad_spare = c.grad_spare, c.grad
        self._pending = self._thread.submit(self.optimizer.step_delayed, grad_scale)
        return refreshes

    def publish(self) -> None:
        """Wait for the update in flight and copy its parameters in (no-op without one)."""
        if self._pending is None:
            return
        future, self._pending = self._pending, None
        future.result()
        with torch.no_grad():
            for c in self.chunks:
                if c.on_ssd(State.PARAM):
                    self.store.put(c.key(State.PARAM), c.pending)
                else:
                    c.param_shard.copy_(c.pending)
        self.refresh.refresh()

    def finish(self) -> None:
        self.publish()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
