"""A small tmpfs mounted for one test (root only, as CI runs): full and read-only filesystems on demand."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str, read_only: bool = False):
    """Mount a tmpfs of ``size`` (mount's notation: "16k", "1m") at ``path`` (created), unmount afterwards."""
    if os.geteuid() != 0:
        pytest.fail("this test mounts a small tmpfs: run it as root (CI does)")
    path.mkdir(exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
