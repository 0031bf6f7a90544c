"""Peak resident memory of a process (or a process and its children), sampled in a background thread."""
from __future__ import annotations

import threading

import psutil


class PeakRSS:
    """Use as ``with PeakRSS() as rss: ...``; then ``rss.peak`` and ``rss.growth`` (peak - RSS at entry), bytes.

    pid: the process to watch (default: this one); children: sum the RSS of its descendants too.
    interval: seconds between samples."""

    def __init__(self, pid: int | None = None, children: bool = False, interval: float = 0.0002):
        self._proc = psutil.Process(pid)
        self._children = children
        self._interval = interval

    def _rss(self) -> int:
        procs = [self._proc] + (self._proc.children(recursive=True) if self._children else [])
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass  # a process ended between listing and measuring
        return total

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.peak = max(self.peak, self._rss())
            except psutil.NoSuchProcess:
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.peak = max(self.peak, self._rss())
        except psutil.NoSuchProcess:
            pass
        self.growth = self.peak - self.base
