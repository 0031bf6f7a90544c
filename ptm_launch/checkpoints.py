"""Where a restarted job resumes: the checkpoint tracker in the ``--load`` directory of the script's arguments.

Megatron-style trainers (pretrain_gpt.py) write ``<save>/latest_checkpointed_iteration.txt`` last, when a
checkpoint is complete, and resume from the iteration it names when started with ``--load``. The launcher only
reads it (on the launching host, so the directory must be shared as the trainer needs anyway) to say where the
restarted ranks resume; it never decides anything from it. The tracker's name is the trainer's
(megatron/training/checkpoint/names.py, a module without imports of the trainer or torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron.training.checkpoint.names import TRACKER


def load_dir_of(args: tuple[str, ...] | list[str]) -> str | None:
    """The value of the last ``--load DIR`` / ``--load=DIR`` among the script's arguments."""
    found = None
    for i, arg in enumerate(args):
        if arg == "--load" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--load="):
            found = arg.split("=", 1)[1]
    return found


@dataclass(frozen=True)
class CheckpointTracker:
    load_dir: Path | None  # None: the script was not given --load

    @classmethod
    def from_args(cls, args: tuple[str, ...] | list[str], cwd: Path) -> "CheckpointTracker":
        load = load_dir_of(args)
        return cls(None if load is None else (cwd / load))

    def latest(self) -> str | None:
        """The tracker's content (an iteration number or 'release'); None without a readable tracker."""
        if self.load_dir is None:
            return None
        try:
            text = (self.load_dir / TRACKER).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        return text or None

    def resume_point(self) -> str:
        """'from iteration 5 (DIR)', 'from the start (no checkpoint in DIR yet)' or 'from its latest checkpoint'."""
        if self.load_dir is None:
            return "from its latest checkpoint"
        latest = self.latest()
        if latest is None:
            return f"from the start (no checkpoint in {self.load_dir} yet)"
        what = f"iteration {int(latest)}" if latest.isdigit() else f"the {latest!r} checkpoint"
        return f"from {what} ({self.load_dir / TRACKER})"

    def resume_note(self) -> str:
        if self.load_dir is None:
            return ("the script has no --load DIR: restarted ranks resume only from what the script finds itself "
                    "(pretrain_gpt.py: pass --save DIR --load DIR --save-interval N)")
        return f"restarted ranks resume from the latest checkpoint in {self.load_dir} (--load)"
