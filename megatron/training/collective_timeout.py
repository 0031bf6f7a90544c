"""How long a collective may wait for its peers: long through start-up, the first step and checkpoints, short
once training runs (torchtitan's ``comm.train_timeout_seconds``).

A host that loses power or its link sends no TCP reset: the others' collectives just wait. With one timeout
for everything, that wait lasts as long as the slowest start-up needs (``--distributed-timeout-minutes``, 10 by
default, as NCCL's). Once the first step has run, every step's collectives are short and alike, so
``--train-timeout-seconds`` lets a silent peer end the round within that many seconds; the rank then names the
collective it waited in (``errors.py``), exits, and torchrun or ``ptm-launch`` restarts the job. Checkpoint
saves and loads get the long timeout back: a rank that writes slowly makes the others wait in the barrier that
ends a save, not in a step.

torch has no public call to change a live group's timeout: ``_set_pg_timeout`` is what torchtitan uses too.
Groups made after the switch keep the timeout they were made with (the long one).
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d


def _set_every_group(timeout: datetime.timedelta) -> None:
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(timeout, group)


class CollectiveTimeout:
    """``startup`` until ``training()`` is called, ``train`` after (None: ``startup`` throughout)."""

    def __init__(self, startup: datetime.timedelta, train: datetime.timedelta | None):
        self.startup, self.train = startup, train
        self._training = False

    def training(self) -> None:
        """The first step is done: from now on the short timeout (once; later calls change nothing)."""
        if self._training or self.train is None or not dist.is_initialized():
            return
        self._training = True
        _set_every_group(self.train)

    @contextlib.contextmanager
    def long(self) -> Iterator[None]:
        """Within: the start-up timeout (a checkpoint's writes and reads can take far longer than a step)."""
        if not self._training:
            yield
            return
        _set_every_group(self.startup)
        try:
            yield
        finally:
            _set_every_group(self.train)
