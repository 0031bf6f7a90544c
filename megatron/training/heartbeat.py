"""Which rank went silent: every rank bumps a counter of its own in the job's store every few seconds, from a
thread, so a rank that timed out in a collective can name the ranks that stopped answering.

A collective's timeout says only that some peer did not take part. A rank whose process is frozen (SIGSTOP, a
hung driver call holding every thread) or whose host lost power or its link stops bumping its counter; one
that is merely slow keeps bumping. ``silent_ranks`` reads every counter twice, ``2.5`` beats apart, and returns
the ranks whose counter did not move. The store is the process group's (torchrun's or rank 0's), one small
write per rank per beat.
"""
from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

BEAT_S = 2.0
_KEY = "ptm_heartbeat/"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()  # torch has no public getter of the group's store


class Heartbeat:
    """Bumps this rank's counter every ``every_s`` seconds until ``close()``."""

    def __init__(self, every_s: float = BEAT_S):
        self.every_s = every_s
        self._key = f"{_KEY}{dist.get_rank()}"
        self._store = _store()
        self._stop = threading.Event()
        self._store.add(self._key, 1)  # present before any collective can time out
        self._thread = threading.Thread(target=self._beat, name="ptm-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        # Also ends with the process group (a run that failed never calls close()).
        while not self._stop.wait(self.every_s) and dist.is_initialized():
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store went away with its host: the collectives will say so
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every_s + 5)


def silent_ranks(every_s: float = BEAT_S) -> list[int]:
    """The ranks whose heartbeat did not move over 2.5 beats; empty when the store cannot be read or this rank
    has no heartbeat."""
    try:
        store = _store()
        if not store.check([f"{_KEY}{dist.get_rank()}"]):  # no heartbeats in this job: nothing to tell
            return []
        # Every rank made its key before training began; one that never did fails the read (its timeout): then
        # nothing is said. Two requests per rank, however many ranks: every rank of a hung job asks at once.
        store.set_timeout(datetime.timedelta(seconds=10))
        keys = [f"{_KEY}{r}" for r in range(dist.get_world_size())]
        first = store.multi_get(keys)
        time.sleep(2.5 * every_s)
        second = store.multi_get(keys)
    except Exception:
        return []
    return [r for r, (a, b) in enumerate(zip(first, second)) if a == b]
