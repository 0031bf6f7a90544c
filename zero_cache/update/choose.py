"""The one place an update mode is chosen: from the config, once, so that no invalid combination exists."""
from __future__ import annotations

from ..chunk import FlatChunk
from ..config import ZeroOptimizationConfig
from ..optimizer import ShardedAdam
from ..param_refresh import ParamRefresh
from ..speculation import Speculation
from ..store import ShardStore
from .base import UpdateStrategy
from .delayed import DelayedUpdate
from .overlapped import OverlappedUpdate
from .speculative import SpeculativeUpdate
from .waiting import WaitingUpdate


def choose_update(z: ZeroOptimizationConfig, optimizer: ShardedAdam, refresh: ParamRefresh,
                  chunks: list[FlatChunk], store: ShardStore, speculation: Speculation | None) -> UpdateStrategy:
    """``lock_free_update`` and ``speculative_update`` exclude each other (config.py refuses both); the
    overlapped step needs something to hide (``ShardedAdam.can_overlap``), else the step waits."""
    if z.lock_free_update:
        return DelayedUpdate(optimizer, refresh, chunks, store)
    if speculation is not None:
        return SpeculativeUpdate(optimizer, refresh, speculation)
    if z.overlap_optimizer_step and optimizer.can_overlap():
        return OverlappedUpdate(optimizer, refresh)
    return WaitingUpdate(optimizer, refresh)
