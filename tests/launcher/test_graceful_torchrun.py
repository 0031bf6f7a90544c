"""graceful_torchrun.py: SIGTERM to torchrun reaches its workers, which save and exit; torchrun then exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ptm_launch.commands import TORCHRUN_PATH
from tests.launcher.launch_utils import REPO

pytestmark = pytest.mark.multiprocess

# A worker that, like pretrain_gpt.py --exit-signal-handler, finishes its "step" after a signal and exits 0.
SAVING_WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
print(f"worker {os.environ['RANK']} ready", flush=True)
while not got:
    time.sleep(0.05)
time.sleep(1.0)  # the step and the save
print(f"worker {os.environ['RANK']} saved after {signal.Signals(got[0]).name}", flush=True)
"""
# One without a handler: the signal kills it, and with restarts left torchrun must not start it again.
PLAIN_WORKER = """
import os, time
print(f"worker {os.environ['RANK']} ready", flush=True)
time.sleep(1000)
"""


def _torchrun(tmp_path, worker: str, *flags: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    return subprocess.Popen([sys.executable, "-u", TORCHRUN_PATH, "--standalone", "--nproc-per-node", "2", *flags,
                             str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_ready(proc: subprocess.Popen, lines: list[str]) -> None:
    ready = 0
    for line in proc.stdout:
        lines.append(line)
        ready += line.count("ready")  # two workers' prints may share a line
        if ready >= 2:
            return
    raise AssertionError("".join(lines))


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_sigterm_to_torchrun_lets_the_workers_finish_and_exits_zero(tmp_path, restarts):
    proc = _torchrun(tmp_path, SAVING_WORKER, "--max-restarts", restarts)
    lines: list[str] = []
    _wait_ready(proc, lines)
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) == 0, out
    assert out.count("saved after SIGTERM") == 2, out
    assert "torchrun: SIGTERM received: passed to its 2 worker(s) as SIGTERM" in out
    assert "Traceback" not in out and "SignalException" not in out


def test_the_whole_process_group_signalled_at_once_is_one_preemption(tmp_path):
    proc = _torchrun(tmp_path, SAVING_WORKER)
    lines: list[str] = []
    _wait_ready(proc, lines)
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun only: the workers have sessions of their own
    for _ in range(2):
        proc.send_signal(signal.SIGTERM)  # copies by other paths (the node agent)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) == 0, out
    assert out.count("saved after SIGTERM") == 2 and out.count("torchrun: SIGTERM received") == 1, out


def test_workers_killed_by_the_signal_are_not_restarted(tmp_path):
    proc = _torchrun(tmp_path, PLAIN_WORKER, "--max-restarts", "3")
    lines: list[str] = []
    _wait_ready(proc, lines)
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) != 0, out
    assert out.count("ready") == 2, f"workers were started again:\n{out}"
