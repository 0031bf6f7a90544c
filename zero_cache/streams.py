"""Copy streams for a compute device: ``HostStreams`` (CPU without an emulator: host and device are one memory,
copies are synchronous and nothing ever waits), ``CudaStreams`` (``torch.cuda.Stream`` / ``torch.cuda.Event``),
and ``make_streams``, which picks one of them or the emulated accelerator's ``EmulatedStreams`` (emulator.py).

What a ``Streams`` object does and the copy path all of them share are in stream_interface.py (below the
emulator, which implements it too); the names of it that the engine uses are exported here as well.
"""
from __future__ import annotations

import threading
from typing import Iterable

import torch

from .config import ZeroCacheConfig, ZeroConfigError
from .emulator import EmulatedStreams
from .pinned_memory import CudaPinning
from .stream_interface import DONE, H2D, STAGING_BUFFERS, CopyStats, Event, Streams

# The interface's names the engine's modules take from here, besides this module's own.
__all__ = ["DONE", "STAGING_BUFFERS", "CopyStats", "Streams", "HostStreams", "CudaEvent", "CudaStreams",
           "separate_memory", "make_streams", "device_copy_streams"]


class HostStreams(Streams):
    """CPU compute without an emulator: one memory; copies happen at once and nothing waits."""

    separate = False

    def compute_event(self) -> Event:
        return DONE

    def wait(self, event: Event) -> None:
        event.synchronize()

    def issue_after(self, event, fn, may_defer):
        event.synchronize()
        return fn()

    def _copy(self, direction, dst, src, after):
        dst.copy_(src)
        return DONE


class CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaStreams(Streams):
    """Two copy streams (host to device, device to host) and a side stream collectives are issued from.
    Copy durations and compute stalls are timed with CUDA events, read once they are done."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.pinning = CudaPinning()
        self.h2d_stream = torch.cuda.Stream(device)
        self.d2h_stream = torch.cuda.Stream(device)
        self.side = torch.cuda.Stream(device)
        self._copies: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()  # copies are issued from the training thread and the host lane

    def _stream_waits(self, stream: torch.cuda.Stream, after: Iterable[Event]) -> None:
        for e in after:
            if isinstance(e, CudaEvent):
                stream.wait_event(e.event)
            else:
                e.synchronize()

    def compute_event(self) -> Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return CudaEvent(ev)

    def wait(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            event.synchronize()
            return
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event.event)
        after.record(stream)  # elapsed(before, after): how long the compute stream stalled on the copy
        with self._lock:
            self._stalls.append((before, after))

    def issue_after(self, event, fn, may_defer):
        self._stream_waits(self.side, [event])
        with torch.cuda.stream(self.side):  # the collective's stream waits for the side stream only
            return fn()

    def _copy(self, direction, dst, src, after):
        stream = self.h2d_stream if direction == H2D else self.d2h_stream
        self._stream_waits(stream, after)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        with self._lock:
            self._copies.append((direction, src.numel() * src.element_size(), start, end))
        return CudaEvent(end)

    def take_stats(self) -> CopyStats:
        """Durations of the copies and stalls that are done; the rest count in a later step."""
        with self._lock:
            copies, self._copies = self._copies, []
            stalls, self._stalls = self._stalls, []
            for direction, nbytes, start, end in copies:
                if end.query():
                    self.meter.copy(direction, nbytes, start.elapsed_time(end) / 1e3)
                else:
                    self._copies.append((direction, nbytes, start, end))
            for before, after in stalls:
                if after.query():
                    self.meter.stalled(before.elapsed_time(after) / 1e3)
                else:
                    self._stalls.append((before, after))
        return self.meter.take()


def separate_memory(cfg: ZeroCacheConfig, device: torch.device) -> bool:
    """Whether host-tier states reach ``device`` only through copies (an accelerator or the emulated one)."""
    return device.type == "cuda" or cfg.zero_optimization.emulated_accelerator.enabled


def make_streams(cfg: ZeroCacheConfig, device: torch.device, rank: int = 0) -> Streams:
    """The copy engines of ``device``: CUDA streams, the emulated accelerator (CPU compute with
    ``zero_optimization.emulated_accelerator.enabled``), or plain host memory."""
    emulated = cfg.zero_optimization.emulated_accelerator
    if emulated.enabled:
        if device.type != "cpu":
            raise ZeroConfigError(f"zero_cache config: 'zero_optimization.emulated_accelerator' emulates an "
                                  f"accelerator for CPU compute, but the model is on {device}; remove the block "
                                  f"or set its 'enabled' to false")
        return EmulatedStreams(emulated, seed=rank)
    if device.type == "cuda":
        return CudaStreams(device)
    return HostStreams()


def device_copy_streams(device: torch.device) -> Streams:
    """The copy engines of a bare ``device`` (no engine config): CUDA streams, or plain host memory on a CPU."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams()
