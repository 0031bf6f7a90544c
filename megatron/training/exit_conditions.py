"""When the training loop saves early or stops: preemption signals, a wall-clock limit, timed saves.

``--exit-signal-handler``: SIGTERM (what Slurm and Kubernetes send before they preempt) or SIGUSR1 only sets a
flag; the step in flight finishes, a checkpoint is saved and the run ends normally (exit 0). A second signal
stops the process at once. ``--exit-duration-in-mins``: the same once that long has passed since start-up.
``--save-interval-minutes``: a save when that long has passed since the last one. Every rank must take the
same decision after the same step, so the flags are combined with one all-reduce (MAX) per iteration, on the
checkpoint code's host group, and only when one of these options is set.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitSignal:
    """Records the first SIGTERM / SIGUSR1; the second one ends the process with that signal."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, _frame) -> None:
        if self.received is not None:  # asked twice: stop now, as the default action would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class Decision:
    save: bool  # save a checkpoint after this iteration
    stop: bool  # and leave the loop
    reason: str = ""


class ExitConditions:
    """Asked once per iteration; agrees with every other rank."""

    def __init__(self, *, signal_handler: bool, duration_mins: float | None, save_interval_mins: float | None,
                 group):
        self.signals = ExitSignal() if signal_handler else None
        self.duration_mins, self.save_interval_mins, self.group = duration_mins, save_interval_mins, group
        self.start = time.monotonic()
        self.active = bool(signal_handler or duration_mins or save_interval_mins)

    def check(self, minutes_since_save: float) -> Decision:
        if not self.active:
            return Decision(False, False)
        elapsed = (time.monotonic() - self.start) / 60.0
        flags = torch.tensor([
            float(self.signals is not None and self.signals.received is not None),
            float(self.duration_mins is not None and elapsed >= self.duration_mins),
            float(self.save_interval_mins is not None and minutes_since_save >= self.save_interval_mins)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        signalled, over_time, save_due = (bool(f) for f in flags.tolist())
        if signalled:
            name = signal.Signals(self.signals.received).name if self.signals.received else "a signal"
            return Decision(True, True, f"{name} received")
        if over_time:
            return Decision(True, True, f"--exit-duration-in-mins {self.duration_mins:g} reached")
        return Decision(save_due, False, "--save-interval-minutes" if save_due else "")

    def close(self) -> None:
        if self.signals is not None:
            self.signals.restore()
