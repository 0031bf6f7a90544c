"""The one error of the checkpoint code: every module here raises it, and callers catch it as a user error."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A missing, truncated or corrupted checkpoint file; the message names it."""


def agreed(check: Callable[[], T], group, elsewhere: str) -> T:
    """``check()`` on every rank of ``group``; if it raised a ``CheckpointError`` on any rank, every rank raises
    (its own error, or one saying ``elsewhere``), so none goes on into a collective the others left."""
    result, error = None, None
    try:
        result = check()
    except CheckpointError as e:
        error = e
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        bad = torch.tensor([1 if error else 0])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        if bad.item() and error is None:
            error = CheckpointError(elsewhere)
    if error is not None:
        raise error
    return result
