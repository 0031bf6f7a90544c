"""When the training loop saves early or stops: preemption signals, a wall-clock limit, timed saves.

``--exit-signal-handler``: SIGTERM (what Slurm and Kubernetes send before they preempt) or SIGUSR1 only sets a
flag; the step in flight finishes, a checkpoint is saved and the run ends normally (exit 0). One preemption
often reaches a rank twice: Slurm and Kubernetes signal every process of the job, and the launcher, its node
agent and torchrun pass the signal on as well (ptm_launch/). So a repeat within ``SAME_REQUEST_S`` of the
first signal is the same request; a later one stops the process at once. ``--exit-duration-in-mins``: the
same once that long has passed since start-up. ``--save-interval-minutes``: a save when that long has passed
since the last one. Every rank must take the same decision after the same step, so the flags are combined
with one all-reduce (MAX) per iteration, on the checkpoint code's host group, and only when one of these
options is set.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAME_REQUEST_S = 10.0  # the copies of one preemption arrive within a second; a human's second try comes later


class ExitSignal:
    """Records the first SIGTERM / SIGUSR1; a repeat ``SAME_REQUEST_S`` or more later ends the process with it."""

    def __init__(self):
        self.received: int | None = None
        self._first = 0.0
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, _frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first = signum, now
        elif now - self._first >= SAME_REQUEST_S:  # asked again: stop now, as the default action would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class Decision:
    save: bool  # save a checkpoint after this iteration
    stop: bool  # and leave the loop
    reason: str = ""


class ExitConditions:
    """Asked once per iteration; agrees with every other rank. ``signal_handler``: True, or the ``ExitSignal``
    the trainer installed at start-up (a signal during start-up then stops the run after its first step instead
    of killing the rank)."""

    def __init__(self, *, signal_handler: bool | ExitSignal, duration_mins: float | None,
                 save_interval_mins: float | None, group):
        self.signals = signal_handler if isinstance(signal_handler, ExitSignal) else \
            ExitSignal() if signal_handler else None
        self.duration_mins, self.save_interval_mins, self.group = duration_mins, save_interval_mins, group
        self.start = time.monotonic()
        self.active = bool(signal_handler or duration_mins or save_interval_mins)

    def check(self, minutes_since_save: float) -> Decision:
        if not self.active:
            return Decision(False, False)
        elapsed = (time.monotonic() - self.start) / 60.0
        flags = torch.tensor([  # the signal's number, so that every rank can name it
            float(self.signals.received or 0) if self.signals is not None else 0.0,
            float(self.duration_mins is not None and elapsed >= self.duration_mins),
            float(self.save_interval_mins is not None and minutes_since_save >= self.save_interval_mins)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        signum, over_time, save_due = (int(f) for f in flags.tolist())
        if signum:
            return Decision(True, True, f"{signal.Signals(signum).name} received")
        if over_time:
            return Decision(True, True, f"--exit-duration-in-mins {self.duration_mins:g} reached")
        return Decision(bool(save_due), False, "--save-interval-minutes" if save_due else "")

    def close(self) -> None:
        if self.signals is not None:
            self.signals.restore()
