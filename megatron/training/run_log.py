"""The logging rank's text log file, and the one line that ends every training run.

Megatron-LM writes its log to stdout only, which is lost with the terminal. Here the logging rank also appends
every line it prints to a file: ``--log-file PATH``, else ``<--save or --tensorboard-dir>/logs/train-<UTC
time>.log`` when either is given (resolved by ``arguments/train.py``), else none. Nothing else is redirected:
the trainer passes its ``RunLog`` to whatever prints the log lines.

The summary line is read back by scripts (examples/start.sh), so its fields and their order are fixed:

    run summary: iterations A-B (N this run) | final lm loss X.XXXXE+00 | tokens/s T | elapsed H:MM:SS |
    checkpoint PATH at iteration B | log PATH

A is the first iteration this run trained and B its last; the loss is the last finite training loss; T the median
tokens/s of the run's log intervals. Without a loss or a logged interval the field says ``n/a``; without
``--save`` the checkpoint field is ``not saved: --save not set``, without a file the last field is ``log stdout
only``.
"""
from __future__ import annotations

import datetime
import os

SUMMARY_PREFIX = "run summary: "


class LogFileError(ValueError):
    """The log file cannot be written: bad input, reported in one line (errors.USER_ERRORS)."""


def default_log_file(directory: str, now: datetime.datetime | None = None) -> str:
    """``directory``/logs/train-<UTC time>.log: one file per run, in the order the runs started."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return os.path.join(directory, "logs", f"train-{now.strftime('%Y%m%d-%H%M%S')}.log")


class RunLog:
    """What the logging rank prints, also appended to ``path`` (None: stdout only). Other ranks pass
    ``enabled=False`` and neither print nor write."""

    def __init__(self, path: str | None, enabled: bool = True):
        self.enabled = enabled
        self.path = path if enabled else None
        self._file = None
        if self.path is not None:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # line-buffered: a crash keeps it
            except OSError as e:
                raise LogFileError(f"cannot write the log file {self.path} ({e.strerror}: {e.filename}); give "
                                  "--log-file a path in a writable directory") from None

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        print(text, flush=True)
        if self._file is not None:
            self._file.write(text + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _hours_minutes_seconds(seconds: float) -> str:
    """H:MM:SS, hours past 24 included (a timedelta would write days)."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def summary_line(*, first_iteration: int, last_iteration: int, final_loss: float | None,
                 tokens_per_s: float | None, elapsed_s: float, checkpoint: str | None, log_path: str | None) -> str:
    """The run's closing line (see the module's docstring); ``checkpoint``: the --save directory, or None."""
    fields = [
        f"iterations {first_iteration}-{last_iteration} ({last_iteration - first_iteration + 1} this run)",
        f"final lm loss {'n/a' if final_loss is None else f'{final_loss:.4E}'}",
        f"tokens/s {'n/a' if tokens_per_s is None else f'{tokens_per_s:.1f}'}",
        f"elapsed {_hours_minutes_seconds(elapsed_s)}",
        f"checkpoint {checkpoint} at iteration {last_iteration}" if checkpoint else "not saved: --save not set",
        f"log {log_path}" if log_path else "log stdout only",
    ]
    return SUMMARY_PREFIX + " | ".join(fields)
