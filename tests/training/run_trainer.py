"""pretrain_gpt.py in a subprocess (one process, or torchrun), and the losses its log lines print."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import TORCHRUN

ROOT = Path(__file__).resolve().parents[2]
_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.]+E[+-]\d+)")


def env() -> dict[str, str]:
    """The environment of a trainer subprocess: this checkout's code first, one thread per process."""
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return out


def start(argv: list[str], nproc: int = 1) -> subprocess.Popen:
    """Start training; stdout and stderr are merged, line-buffered text."""
    if nproc == 1:
        cmd = [sys.executable, "pretrain_gpt.py", *argv]
    else:
        cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "pretrain_gpt.py", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)


def run(argv: list[str], nproc: int = 1, timeout: float = 300) -> tuple[int, str]:
    proc = start(argv, nproc)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def losses(output: str) -> dict[int, float]:
    """Iteration -> the loss its log line printed (--log-interval 1)."""
    return {int(i): float(v) for i, v in _LOSS.findall(output)}
