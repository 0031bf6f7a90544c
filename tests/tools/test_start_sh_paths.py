"""examples/start.sh takes relative paths in its environment from the caller's directory, not the checkout's."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def test_relative_paths_are_the_callers(tmp_path):
    """SAVE_DIR (the plan is kept there), DS_CONFIG (the trainer reads it: a broken one is its one-line error,
    naming the caller's file), TENSORBOARD_DIR and LOG_DIR (the run's output is kept there), all relative to where
    start.sh is run."""
    (tmp_path / "ds.json").write_text("{not json")
    env = {**os.environ, "SAVE_DIR": "ckpt", "DS_CONFIG": "ds.json", "TENSORBOARD_DIR": "tb", "LOG_DIR": "logs",
           "TRAIN_ITERS": "2", "SEQ_LEN": "64"}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "start.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert (tmp_path / "ckpt" / "plan" / "plan.txt").is_file(), out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and str(tmp_path / "ds.json") in errors[0], out[-3000:]
    assert len(list((tmp_path / "logs").glob("start-*.log"))) == 1
    assert not any((ROOT / name).exists() for name in ("ckpt", "tb", "logs"))
