"""Checkpoints on a full disk: a check before writing, and one clear error (without partial files) after.

A save whose size is known is refused before it starts when the filesystem has less free space than this
rank writes; a write that still runs out of space (other writers, quotas, compression) raises the same
``CheckpointError`` once the caller has removed what it wrote, instead of the zip writer's
``unexpected pos`` or a bare ``OSError``.
"""
from __future__ import annotations

import errno
import os
import shutil

from .errors import CheckpointError

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch.save's zip writer reports a failed write as a RuntimeError without the errno.
_TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or ".").free


def is_no_space(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in _NO_SPACE_ERRNOS
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE_FAILURES)


def no_space_error(path: str, needed: int | None = None, free: int | None = None) -> CheckpointError:
    """The error of a write to ``path`` that ran out of space (its partial files were removed), or, with
    ``needed``, of one refused before it started."""
    free = free_bytes(path) if free is None else free
    what = (f"{free} bytes free; the partial files were removed" if needed is None
            else f"{needed} bytes needed, {free} bytes free; nothing was written")
    return CheckpointError(f"no space left on the filesystem of {path}: {what}; free space there or save elsewhere "
                           f"(--save)")


def check_free(path: str, needed: int) -> None:
    """Raise the no-space error before a write of ``needed`` bytes that cannot fit."""
    free = free_bytes(path)
    if needed > free:
        raise no_space_error(path, needed, free)
