"""One piece of checkpoint work at a time in a thread beside training (``--async-save``, snapshots)."""
from __future__ import annotations

import threading
from typing import Callable

import torch


class BackgroundWork:
    """``start(fn, *args)`` runs ``fn`` in a daemon thread on ``device`` (a CUDA thread needs its device set);
    ``join()`` waits for it and raises what it raised."""

    def __init__(self, name: str, device: torch.device):
        self.name, self.device = name, device
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn: Callable[..., None], *args) -> None:
        self.join()
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True, name=self.name)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            fn(*args)
        except BaseException as e:  # raised in the training thread by join()
            self._error = e

    def join(self) -> bool:
        """Wait for the work in flight; False when there was none."""
        if self._thread is None:
            return False
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True
