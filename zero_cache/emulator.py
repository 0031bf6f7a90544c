"""An emulated accelerator for CPU runs (``zero_optimization.emulated_accelerator``).

The device tier stays CPU memory, accounted under its own budget, but every byte that crosses between it
and host memory goes through ``EmulatedStreams``, which behaves as a GPU's copy engines do:

- two copy streams (host to device, device to host), each a worker thread running its copies in issue
  order, concurrently with the training thread (compute) and with each other;
- a copy starts once the events it was told to wait for are done, then takes ``nbytes / bandwidth`` plus a
  random extra delay (``random_delay_ms``, uniform, its own random stream per copy stream and rank);
- while a copy is in flight its destination holds NaN (integers: a fill pattern) and the data are written
  when it lands, reading the source at that time. A reader that skips a wait sees NaN or stale values, and
  a writer that reuses a source too early changes what lands, so a missing wait gives wrong numbers
  instead of passing by luck;
- memory is freed at once (no caching allocator), so device memory a copy wrote is freed only after that
  copy is done (``before_free``);
- the compute stream is the training thread itself: ``compute_event`` is done at once and ``wait`` blocks
  the thread (the time is counted as compute blocked on copies);
- ``issue_after(event, fn)`` with gloo's point-to-point collectives runs ``fn`` on the host-to-device
  stream after the copies queued before it, as a GPU issues a collective from a stream that waits for the
  copy; every all-gather of the coordinator goes that way, so their order is the same on every rank.
  Other collectives are issued by the training thread after waiting for the event.

Host tensors count as pinned when they view a mapping registered as pinned (pinned_memory.py: the staging
pools, the host arena of ``pin_memory`` shards, the SSD tier's staging buffers); the others are staged, as
pageable memory must be on a GPU.
"""
from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable

import torch

from .config import EmulatedAcceleratorConfig
from .stream_interface import D2H, DONE, H2D, Event, Streams

_INT_POISON = 0x5A


def _check_alive(dst: torch.Tensor, where: int) -> None:
    """A destination freed (or moved) while its copy is in flight is a race of the caller; it fails the copy
    instead of writing into memory that is no longer the destination's."""
    storage = dst.untyped_storage()
    if dst.data_ptr() != where or storage.nbytes() < dst.storage_offset() * dst.element_size() + dst.nbytes:
        raise RuntimeError("emulated accelerator: a copy's destination was freed or moved while the copy was in "
                           "flight (a missing wait before the buffer was released)")


class EmulatedEvent(Event):
    def __init__(self):
        self._flag = threading.Event()
        self._error: BaseException | None = None

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()
        if self._error is not None:
            raise self._error

    def _set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._flag.set()


class _Stream:
    """One emulated stream: a thread running its items in order; each item's event is set when it ran."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"zero_cache_{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> EmulatedEvent:
        ev = EmulatedEvent()
        self._queue.put((fn, ev))
        return ev

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, ev = item
            try:
                fn()
            except BaseException as e:  # the waiter raises it
                ev._set(e)
            else:
                ev._set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class _Deferred:
    """A collective issued later by a stream; ``wait()`` waits for the issue (blocked on the copy), then for
    the collective."""

    def __init__(self, future: Future, streams: "EmulatedStreams"):
        self._future, self._streams = future, streams

    def wait(self) -> None:
        t0 = time.perf_counter()
        handle = self._future.result()
        self._streams.meter.blocked(time.perf_counter() - t0)
        handle.wait()


class EmulatedStreams(Streams):
    def __init__(self, cfg: EmulatedAcceleratorConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self._bandwidth = {H2D: cfg.h2d_gbps * 1e9, D2H: cfg.d2h_gbps * 1e9}
        self._rng = {H2D: random.Random(2 * seed), D2H: random.Random(2 * seed + 1)}  # each used by its thread
        self._streams = {H2D: _Stream(H2D), D2H: _Stream(D2H)}
        self._pinned: set[int] = set()  # storage data pointers of "pinned" host memory
        self.pinning = self

    def compute_event(self) -> Event:
        return DONE

    def wait(self, event: Event) -> None:
        if event.query():
            event.synchronize()  # raises a failed copy's error
            return
        t0 = time.perf_counter()
        event.synchronize()
        self.meter.blocked(time.perf_counter() - t0)

    def issue_after(self, event: Event, fn: Callable, may_defer: bool):
        if not may_defer:
            self.wait(event)
            return fn()
        future: Future = Future()

        def issue():
            event.synchronize()
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)
        self._streams[H2D].submit(issue)
        return _Deferred(future, self)

    def before_free(self, event: Event) -> None:
        self.wait(event)  # a free is immediate here: a copy still in flight would write freed memory

    # Pinning (pinned_memory.Pinning): host memory registered by its mapping's start, which is the storage data
    # pointer of every tensor viewing it.
    def register(self, ptr: int, nbytes: int) -> bool:
        self._pinned.add(ptr)
        return True

    def unregister(self, ptr: int) -> None:
        self._pinned.discard(ptr)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._pinned

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event]) -> Event:
        after = [e for e in after if not e.query()]
        nbytes = src.numel() * src.element_size()
        seconds = nbytes / self._bandwidth[direction]
        rng, delay_ms = self._rng[direction], self.cfg.random_delay_ms

        where = dst.data_ptr()

        def run():
            for e in after:
                e.synchronize()
            t0 = time.perf_counter()
            _check_alive(dst, where)
            if dst.is_floating_point():
                dst.fill_(float("nan"))
            else:
                dst.fill_(_INT_POISON)
            pause = seconds + (rng.uniform(0.0, delay_ms) / 1e3 if delay_ms > 0 else 0.0)
            if pause > 0:
                time.sleep(pause)
            _check_alive(dst, where)
            dst.copy_(src)
            self.meter.copy(direction, nbytes, time.perf_counter() - t0)
        return self._streams[direction].submit(run)

    def close(self) -> None:
        for s in self._streams.values():
            s.close()
