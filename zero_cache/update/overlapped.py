"""The overlapped step (``overlap_optimizer_step``): the host's share of the update runs under the next forward.

The device sub-groups are updated by the calling thread first (their kernels queue on the compute stream
ahead of the forward's); the host and SSD ones are walked on a thread of the strategy's own, resident chunks
first (the step all-gathers them before it returns), then in chunk order, which is the order the next forward
gathers them. So the forward runs behind the walk: ``before_gather(c)`` blocks until chunk ``c``'s update is
done and its parameter shard handed on (its SSD write queued, which the gather's read waits for; its copy to
the device queued, which the compute stream is then made to wait for), and ``may_gather(c)`` says whether
that would block. The result is the same as the waiting step's; only the time the step was blocked moves
into the forward. ``join`` waits for the walk, makes the compute stream wait for the copies nobody waited
for yet, and raises the walk's error, if any.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..optimizer import ShardedAdam, SwapStats
from ..param_refresh import ParamRefresh
from .base import UpdateStrategy


class OverlappedUpdate(UpdateStrategy):
    def __init__(self, optimizer: ShardedAdam, refresh: ParamRefresh):
        super().__init__(optimizer, refresh)
        self._walker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_cache_step")
        self._running: Future | None = None
        self._updated: set[int] = set()  # chunks the walk has updated so far (guarded by _progress)
        self._landing: dict[int, object] = {}  # chunk -> its write-back copy's event, not yet waited for
        self._progress = threading.Condition()
        self._blocked = 0.0  # seconds the training thread has been blocked on the walk
        self.last_blocked = 0.0  # ... by the last step's walk

    def apply(self, grad_scale: float, unclipped: bool) -> int:
        if self._running is not None:
            raise RuntimeError("OverlappedUpdate.apply: the last step's update has not been joined")
        opt = self.optimizer
        reads = opt.begin()
        device = opt.device_sub_groups()
        opt.walk(device, grad_scale, {})  # device kernels, queued ahead of the next forward's
        self._updated, self._blocked = {i for k in device for i in opt.sub_groups[k]}, 0.0
        # Resident chunks first: the step all-gathers them before it returns (the others wait for the forward).
        host = sorted((k for k in range(len(opt.sub_groups)) if k not in device),
                      key=lambda k: not any(opt.chunks[i].plan.resident for i in opt.sub_groups[k]))
        self._running = self._walker.submit(opt.walk, host, grad_scale, reads, self)
        self._running.add_done_callback(lambda _: self.updated(()))
        for c in self.refresh.resident:
            self.before_gather(c.index)
        self.refresh.refresh()
        return 1

    # ---- the walk's progress (optimizer.WalkProgress), from the walk's thread ------------------------------
    def landed(self, chunk: int, event) -> None:
        with self._progress:
            self._landing[chunk] = event

    def updated(self, chunks) -> None:
        with self._progress:
            self._updated.update(chunks)
            self._progress.notify_all()

    # ---- gathers wait for their chunk's update (lifecycle) ----------------------------------------------------
    def may_gather(self, chunk: int) -> bool:
        """True unless the walk is still to update ``chunk`` (or has failed before it)."""
        return self._running is None or chunk in self._updated

    def before_gather(self, chunk: int) -> None:
        """Block until the walk has updated ``chunk``, then order the compute stream after its copy to the
        device, if any; raises the walk's error if it failed. Called by the training thread."""
        run = self._running
        if run is None:
            return
        if chunk not in self._updated:
            t0 = time.perf_counter()
            with self._progress:
                while chunk not in self._updated and not run.done():
                    self._progress.wait()
            self._blocked += time.perf_counter() - t0
            if chunk not in self._updated:
                self.join()  # raises the walk's error
                raise RuntimeError(f"the optimizer step ended without updating chunk {chunk}")
        self._hand_copy(chunk)

    def _hand_copy(self, chunk: int) -> None:
        with self._progress:
            landing = self._landing.pop(chunk, None)
        if landing is not None:
            self.optimizer.streams.wait(landing)

    # ---- the end of the walk ---------------------------------------------------------------------------------
    def in_flight(self) -> bool:
        """A walk is running, or has ended and nobody has joined it yet."""
        return self._running is not None

    def join(self) -> str | None:
        run = self._running
        if run is None:
            return None
        t0 = time.perf_counter()
        try:
            wait([run])
        finally:
            self._blocked += time.perf_counter() - t0
            self._running = None
            for chunk in list(self._landing):
                self._hand_copy(chunk)
        self.last_blocked = self._blocked
        run.result()
        opt = self.optimizer
        if any(opt.swapped):
            opt.end(self._blocked)
            return str(opt.last_swap)
        return f"blocked {self.last_blocked * 1e3:.1f}ms"

    def step_swap_stats(self) -> SwapStats | None:
        return None  # the walk's traffic is known when it is joined

    def close(self) -> None:
        self._walker.shutdown(wait=True)
