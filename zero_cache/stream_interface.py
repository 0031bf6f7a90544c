"""Copy streams and events: how host <-> device copies are scheduled, one code path for a GPU and for CPU tests.

Bytes cross between host memory and the compute device in three places: parameter shards before their
all-gathers (host to device), gradient shards after their reduce-scatters (device to host) and updated
parameters after the host optimizer (host to device). The coordinator, the reducer and the optimizer
schedule all three through a ``Streams`` object:

- ``h2d(dst, src, after)``: an asynchronous copy on the host-to-device copy stream, started once the events
  in ``after`` are done; returns a ``Transfer``: ``done`` (the copy landed in ``dst``) and ``source_free``
  (``src`` may be changed or reused).
- ``d2h_staged(src, after)``: a copy on the device-to-host stream into a staging buffer of the pinned pool;
  the consumer synchronizes the returned event, reads the buffer and ``release``s it.
- ``compute_event()``: the current point of the compute stream. A copy into memory that compute used or
  allocated waits for it (the block may still be read by kernels queued before it).
- ``wait(event)``: the compute stream waits (on a GPU the host does not block); ``synchronize(event)``: the
  calling host thread waits.
- ``issue_after(event, fn, may_defer)``: run ``fn`` (it issues a collective) ordered after ``event`` only,
  not after the compute stream: on a GPU the collective is issued from a side stream that waits for the
  event, so its NCCL stream waits for the copy and not for the kernels queued on the compute stream.

Pageable host memory cannot be read by a copy engine asynchronously: a pageable source is first copied (by
the calling thread) into a buffer of a bounded pinned pool, double-buffered, and the copy reads that buffer.
A copy that changes the dtype (an fp32 master written back to a bf16 parameter shard) is staged the same
way, cast by that host copy, so it crosses in the destination's dtype. Pinned memory is mapped and pinned
in place (pinned_memory.py), never copied into pinned blocks.
A pool buffer is handed out again only once the copy that last used it is done (its guard event); buffers
are never reused by luck, and no ``record_stream`` is needed because every device tensor a copy reads or
writes is kept referenced until the copy's event is done.

This module is the interface and the copy path every implementation shares. Implementations: ``HostStreams``
and ``CudaStreams`` (streams.py, which also picks one for a device: ``make_streams``) and ``EmulatedStreams``
(emulator.py: worker threads at a configured bandwidth, for CPU tests).
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .aio import AlignedBuffer
from .pinned_memory import Pinning

H2D, D2H = "h2d", "d2h"
# Pinned staging buffers per direction. Host to device: double-buffered, one being copied while the next is
# filled. Device to host: one more, since the host lane holds a buffer while it accumulates from it.
STAGING_BUFFERS = {"h2d": 2, "d2h": 3}
LENT_TIMEOUT_S = 600.0  # a staging buffer lent this long was lost by a failed consumer: raise, never hang


class Event(ABC):
    """A point on a stream: done once everything issued there before it has run."""

    @abstractmethod
    def query(self) -> bool:
        ...

    @abstractmethod
    def synchronize(self) -> None:
        ...


class _Done(Event):
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE: Event = _Done()


@dataclass(frozen=True)
class Transfer:
    done: Event  # the copy landed in its destination
    source_free: Event  # the source may be changed or reused (done, unless it was staged first)


@dataclass(frozen=True)
class CopyStats:
    """Host <-> device copies of one step on this rank."""
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    copies: int = 0
    issued_seconds: float = 0.0  # sum of the copies' durations on their streams
    blocked_seconds: float = 0.0  # time the training thread (compute) sat waiting for copies
    lane_wait_seconds: float = 0.0  # time the training thread waited for the host lane (gradients landing)
    host_waits: int = 0  # times the training thread itself waited for a copy still running (a host sync on a GPU)

    @property
    def hidden(self) -> float:
        """Share of the copy time that did not block compute (1 = all hidden)."""
        if self.issued_seconds <= 0:
            return 1.0
        return max(0.0, self.issued_seconds - self.blocked_seconds) / self.issued_seconds

    def __str__(self) -> str:
        return (f"copies H2D {self.h2d_bytes / 2**20:.2f}MiB D2H {self.d2h_bytes / 2**20:.2f}MiB ({self.copies}), "
                f"issued {self.issued_seconds * 1e3:.1f}ms, blocked compute {self.blocked_seconds * 1e3:.1f}ms "
                f"({100 * self.hidden:.0f}% hidden), host lane wait {self.lane_wait_seconds * 1e3:.1f}ms")


class CopyMeter:
    """Thread-safe sums behind ``CopyStats``; ``take()`` returns them and starts over."""

    def __init__(self):
        self._lock = threading.Lock()
        self._main = threading.get_ident()  # the training thread: its waits are compute waits
        self._reset()

    def _reset(self) -> None:
        self._bytes = {H2D: 0, D2H: 0}
        self._copies = self._host_waits = 0
        self._issued = self._blocked = self._lane = 0.0

    def on_main_thread(self) -> bool:
        return threading.get_ident() == self._main

    def copy(self, direction: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes[direction] += nbytes
            self._copies += 1
            self._issued += seconds

    def blocked(self, seconds: float) -> None:
        """A wait of the calling thread; it blocked compute when that is the training thread."""
        if self.on_main_thread():
            self.stalled(seconds)

    def stalled(self, seconds: float) -> None:
        """Compute stalled for ``seconds`` on copies (a GPU stall measured on the compute stream)."""
        with self._lock:
            self._blocked += seconds

    def host_wait(self) -> None:
        """The calling thread is about to block on a copy that is not done; counted for the training thread."""
        if self.on_main_thread():
            with self._lock:
                self._host_waits += 1

    def lane_wait(self, seconds: float) -> None:
        with self._lock:
            self._lane += seconds

    def take(self) -> CopyStats:
        with self._lock:
            out = CopyStats(self._bytes[H2D], self._bytes[D2H], self._copies, self._issued, self._blocked,
                            self._lane, self._host_waits)
            self._reset()
        return out


class StagingPool:
    """Bounded, reused pinned host buffers of one size (the largest transfer staged through them).

    ``acquire`` hands out a buffer whose guard event is done; with every buffer lent or guarded it waits for
    the oldest guarded one (or for a release). ``release(view, guard)``: the buffer is free once ``guard`` is."""

    def __init__(self, unit_bytes: int, buffers: int, allocate: Callable[[int], torch.Tensor], meter: CopyMeter):
        self.unit = max(1, unit_bytes)
        self.buffers = buffers
        self._allocate = allocate
        self._meter = meter
        self._free: list[tuple[torch.Tensor, Event]] = []  # oldest first
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> buffer
        self._count = 0
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        return self._count * self.unit

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if nbytes > self.unit:
            raise ValueError(f"staging request of {nbytes} bytes exceeds the pinned staging buffers ({self.unit} "
                             f"bytes each, sized by the largest shard)")
        t0 = time.perf_counter()
        while True:
            with self._cond:
                ready = next((i for i, (_, guard) in enumerate(self._free) if guard.query()), None)
                if ready is not None:
                    buf, guard = self._free.pop(ready)
                elif self._count < self.buffers:
                    buf, guard = self._allocate(self.unit), DONE
                    self._count += 1
                elif self._free:
                    buf, guard = self._free.pop(0)  # the oldest copy finishes first
                elif not self._cond.wait(LENT_TIMEOUT_S):  # every buffer is lent: a consumer returns one
                    raise RuntimeError(f"zero_cache: all {self.buffers} pinned staging buffers have been lent for "
                                       f"{LENT_TIMEOUT_S:.0f} s and none came back (a copy's consumer failed "
                                       f"without returning its buffer; its error is the one to look for)")
                else:
                    continue
                self._lent[buf.data_ptr()] = buf
            if not guard.query():
                self._meter.host_wait()
            guard.synchronize()
            waited = time.perf_counter() - t0
            if waited > 1e-4:
                self._meter.blocked(waited)
            return buf[:nbytes].view(dtype)

    def release(self, view: torch.Tensor, guard: Event = DONE) -> None:
        with self._cond:
            buf = self._lent.pop(view.data_ptr())
            self._free.append((buf, guard))
            self._cond.notify()


class Streams(ABC):
    """The compute device's copy engines; see the module docstring. ``separate``: host and device memory
    differ, so host-tier shards reach the device only through copies. ``pinning``: how host memory is pinned
    in place for them (pinned_memory.py; None where nothing needs pinning)."""

    separate = True
    pinning: Pinning | None = None

    def __init__(self):
        self.meter = CopyMeter()
        self.h2d_pool: StagingPool | None = None
        self.d2h_pool: StagingPool | None = None

    # ---- primitives (per implementation) ---------------------------------------------------------------
    @abstractmethod
    def compute_event(self) -> Event:
        ...

    @abstractmethod
    def wait(self, event: Event) -> None:
        ...

    def synchronize(self, event: Event) -> None:
        """The calling thread waits for ``event`` (on a GPU, a host synchronisation)."""
        if not event.query():
            self.meter.host_wait()
        t0 = time.perf_counter()
        event.synchronize()
        self.meter.blocked(time.perf_counter() - t0)

    @abstractmethod
    def issue_after(self, event: Event, fn: Callable, may_defer: bool):
        ...

    def pinned(self, t: torch.Tensor) -> bool:
        """Whether a copy engine reads ``t`` directly (else it is staged through the pinned pool)."""
        return self.pinning is None or self.pinning.is_pinned(t)

    def before_free(self, event: Event) -> None:  # noqa: B027 (a no-op unless an implementation overrides it)
        """Device memory a copy wrote (``event``) is about to be freed or reused by the host's bookkeeping. On a
        GPU nothing to do: the caching allocator reuses a block in compute-stream order, and compute waited
        for the copy before it read the block. Where frees are immediate (the emulator) the host waits."""

    @abstractmethod
    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event]) -> Event:
        ...

    def _allocate_pinned(self, nbytes: int) -> torch.Tensor:
        """A staging buffer: a mapping of its own, pinned in place (no power-of-two rounding)."""
        return AlignedBuffer(nbytes, self.pinning).view(torch.uint8, nbytes)

    def take_stats(self) -> CopyStats:
        return self.meter.take()

    def close(self) -> None:  # noqa: B027 (a no-op unless an implementation overrides it)
        """Stop worker threads (the emulator's)."""

    # ---- the copy path ---------------------------------------------------------------------------------
    def configure_staging(self, h2d_unit: int, d2h_unit: int) -> None:
        """Size the pinned pools by the largest transfer each direction stages (bytes)."""
        if h2d_unit:
            self.h2d_pool = StagingPool(h2d_unit, STAGING_BUFFERS[H2D], self._allocate_pinned, self.meter)
        if d2h_unit:
            self.d2h_pool = StagingPool(d2h_unit, STAGING_BUFFERS[D2H], self._allocate_pinned, self.meter)

    @property
    def staging_bytes(self) -> int:
        """Pinned staging memory held now."""
        return sum(p.held for p in (self.h2d_pool, self.d2h_pool) if p is not None)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event] = ()) -> Transfer:
        if self.pinned(src) and src.dtype == dst.dtype:
            done = self._copy(H2D, dst, src, after)
            return Transfer(done, done)
        # Pageable memory, or a cast: the calling thread writes a pinned buffer in the destination's dtype, so a
        # 16-bit parameter shard written back from its fp32 master crosses as 16 bits (torch would cast it into
        # a pageable temporary and copy that synchronously).
        staging = self.h2d_pool.acquire(src.numel(), dst.dtype)
        done = DONE
        try:
            staging.copy_(src.reshape(-1))
            done = self._copy(H2D, dst, staging.view(src.shape), after)
        finally:  # returned whatever happens, free once the copy (if one started) no longer reads it
            self.h2d_pool.release(staging, done)
        return Transfer(done, DONE)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event] = ()) -> Event:
        """Copy device tensor ``src`` into the caller's pinned host tensor ``dst`` (same dtype): the copy's event.
        The caller keeps ``src`` referenced, and reads ``dst`` only, once the event is done."""
        if not self.pinned(dst) or dst.dtype != src.dtype:
            raise ValueError("d2h copies into a pinned host tensor of the source's dtype; use d2h_staged otherwise")
        return self._copy(D2H, dst, src, after)

    def d2h_staged(self, src: torch.Tensor, after: Iterable[Event] = ()) -> tuple[torch.Tensor, Event]:
        """Copy device tensor ``src`` into a pinned staging buffer: (the buffer, its copy's event). The caller
        keeps ``src`` referenced until the event is done and ``release``s the buffer after reading it."""
        staging = self.d2h_pool.acquire(src.numel(), src.dtype)
        try:
            return staging, self._copy(D2H, staging, src.reshape(-1), after)
        except BaseException:
            self.d2h_pool.release(staging)
            raise

    def release(self, staging: torch.Tensor) -> None:
        self.d2h_pool.release(staging)
