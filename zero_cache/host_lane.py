"""The host lane: one thread that does the host's share of the work while the device computes.

With an accelerator (or the emulated one) and states in host memory, the host has work of its own that
need not hold up the training thread: gradient shards arriving from the device are accumulated into the
host gradient shards and their norm statistics taken (grad_reducer.py), sub-groups may be updated
speculatively (speculation.py), and in the optimizer step the host and SSD sub-groups are updated here
while the device updates its own (optimizer.py). Tasks run one at a time in submission order, so tasks on
the same shard never race. ``drain()`` waits for every task submitted so far and re-raises the first
error a task raised.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .stream_interface import CopyMeter


class HostLane:
    def __init__(self, meter: CopyMeter | None = None):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_cache_host_lane")
        self._futures: list[Future] = []
        self._meter = meter

    def submit(self, fn: Callable, *args) -> Future:
        future = self._pool.submit(fn, *args)
        self._futures.append(future)
        if len(self._futures) > 64:  # keep the list short; finished tasks' errors are kept until drain
            self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]
        return future

    def drain(self) -> None:
        """Wait for every task submitted so far; raise the first error."""
        t0 = time.perf_counter()
        futures, self._futures = self._futures, []
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # wait for the others before raising: none may still run
                error = error or e
        if self._meter is not None and self._meter.on_main_thread():
            self._meter.lane_wait(time.perf_counter() - t0)
        if error is not None:
            raise error

    def close(self) -> None:
        self._pool.shutdown(wait=True)
