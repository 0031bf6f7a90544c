"""How a step's optimizer update runs: one strategy class per mode, chosen once from the config (``choose``).

- ``WaitingUpdate``: the step updates every shard before it returns;
- ``OverlappedUpdate``: the host's share runs under the next forward, each gather waiting for its chunk;
- ``DelayedUpdate`` (``lock_free_update``): step t's update runs while step t+1 computes and is published at
  step t+1's end;
- ``SpeculativeUpdate``: host sub-groups are updated during the backward and kept when the step's norm shows
  neither clipping nor overflow.
"""
from .base import UpdateStrategy
from .choose import choose_update
from .delayed import DelayedUpdate
from .overlapped import OverlappedUpdate
from .speculative import SpeculativeUpdate
from .waiting import WaitingUpdate

__all__ = ["UpdateStrategy", "choose_update", "WaitingUpdate", "OverlappedUpdate", "DelayedUpdate",
           "SpeculativeUpdate"]
