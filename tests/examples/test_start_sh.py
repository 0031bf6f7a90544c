"""examples/start.sh, the README's main command: sizes table, and a short real run on the sample corpus."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from ptm_planner.sizes import table

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, env=None, timeout=600):
    return subprocess.run(["bash", "examples/start.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_list_prints_the_sizes_table():
    proc = _run("list")
    assert (proc.returncode, proc.stdout) == (0, table() + "\n"), proc.stderr


def test_unknown_size_prints_the_table():
    proc = _run("bogus")
    assert proc.returncode == 2
    assert "unknown SIZE 'bogus'" in proc.stdout
    for size in ("default", "125m", "1.3b", "28 ", "55 "):
        assert size in proc.stdout
    assert re.search(r"^\s*55\s+68\s+8192\s+64\s+32768\s+10$", proc.stdout, re.M)
    assert re.search(r"^\s*28\s+26\s+8192\s+128\s+32768\s+38$", proc.stdout, re.M)


def test_default_run_trains_on_the_sample_corpus(tmp_path):
    """Corpus -> tokenizer -> preprocess -> 2-process training, then resume from its checkpoint."""
    env = {"TRAIN_ITERS": "4", "SEQ_LEN": "64", "MBS": "2", "LOG_INTERVAL": "2", "EVAL_INTERVAL": "4",
           "EVAL_ITERS": "1", "SAVE_DIR": str(tmp_path / "ckpt"), "SAVE_INTERVAL": "2"}
    proc = _run(env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^\[start.sh\] fits: default GPT", proc.stdout, re.M)  # the memory planner was consulted
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", proc.stdout)]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert "validation loss at iteration 4" in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ROOT / "data" / "sample" / "corpus_text_document.idx").is_file()
    proc = _run(env={**env, "TRAIN_ITERS": "6"})  # resumes at 4
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[start.sh] reusing the memory plan in {tmp_path / 'ckpt' / 'plan'}" in proc.stdout
    assert "starting at iteration 4" in proc.stdout
    assert re.search(r"iteration\s+6/\s+6", proc.stdout)


def test_a_bad_flag_is_the_trainers_one_line_and_exit_code(tmp_path):
    """Bad input reaches the user as the trainer's line and exit code 2, not as the launcher's report."""
    proc = _run(env={"TRAIN_ITERS": "2", "SEQ_LEN": "64", "EXTRA_ARGS": "--clip-grad -1"})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr  # the launcher passes the ranks' lines through on stdout
    errors = [ln for ln in out.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "--clip-grad must be >= 0" in errors[0], out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out


def test_size_that_cannot_fit_is_refused_before_anything_starts():
    """start.sh 55 on a 24 GiB CPU node (given explicitly, so the test does not depend on this machine)."""
    import time

    t0 = time.monotonic()
    proc = _run("55", env={"NPROC": "2", "PLAN_ARGS": "--host-memory-gib 24 --nvme-free-gib 70"}, timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^does not fit: 55 GPT 54\.\d\dB parameters \(68 layers", proc.stdout, re.M)
    assert re.search(r"the largest examples/start.sh size that fits: \S+", proc.stdout)
    assert "the requested model needs (states on SSD)" in proc.stdout
    assert "[start.sh] size 55 cannot be trained here (memory planner exit 3); nothing was started" in proc.stdout
    assert "[start.sh] size=" not in proc.stdout and "> model:" not in proc.stdout  # no training was launched
    assert time.monotonic() - t0 < 120
