"""Preemption: SIGTERM / SIGUSR1 with --exit-signal-handler, --exit-duration-in-mins, --save-interval-minutes."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.training.parallel_harness import TINY_GPT
from tests.training.run_trainer import ROOT, env, losses, run, start

pytestmark = pytest.mark.multiprocess

ITERS = 40
BASE = [a for a in TINY_GPT if a not in ("--train-iters", "10", "--log-interval", "5")] + \
    ["--log-interval", "1", "--train-iters", str(ITERS)]


def _tracker(ckpt: str) -> int:
    return int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read())


def _wait_for_iteration(proc, lines: list[str], n: int) -> None:
    for line in proc.stdout:
        lines.append(line)
        if re.search(rf"iteration\s+{n}/", line):
            return
    raise AssertionError("".join(lines))


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    code, out = run(BASE)
    assert code == 0, out
    return losses(out)


def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, reference):
    sig = signal.SIGTERM
    ckpt = str(tmp_path / "ckpt")
    argv = BASE + ["--save", ckpt, "--load", ckpt, "--exit-signal-handler"]
    proc = start(argv)
    lines: list[str] = []
    _wait_for_iteration(proc, lines, 3)
    os.kill(proc.pid, sig)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == 0, out
    stopped = int(re.search(rf"{sig.name} received: stopping at iteration (\d+) after saving it", out).group(1))
    assert 3 <= stopped < ITERS and _tracker(ckpt) == stopped
    code, rest = run(argv)
    assert code == 0, rest
    resumed = losses(rest)
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    for it, loss in {**losses(out), **resumed}.items():
        assert loss == pytest.approx(reference[it], rel=1e-6), f"iteration {it}"


def test_second_signal_stops_at_once():
    script = ("import os, signal, sys, time\n"
              "from megatron.training.exit_conditions import ExitSignal\n"
              "handler = ExitSignal()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(0.2)\n"
              "assert handler.received == signal.SIGTERM\n"
              "print('first signal recorded', flush=True)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(10)\n"
              "print('still running')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout.strip() == "first signal recorded"


def test_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, reference):
    """Slurm signals every task; a signal that reaches one rank only must still stop them all together. SIGUSR1
    here (what ``sbatch --signal=USR1@...`` sends), SIGTERM above: the handler takes both."""
    ckpt = str(tmp_path / "ckpt")
    proc = start(BASE + ["--save", ckpt, "--exit-signal-handler"], nproc=2)
    lines: list[str] = []
    _wait_for_iteration(proc, lines, 3)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "pretrain_gpt.py" in " ".join(p.cmdline())]
    assert len(workers) == 2
    workers[1].send_signal(signal.SIGUSR1)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == 0, out
    stopped = int(re.search(r"SIGUSR1 received: stopping at iteration (\d+)", out).group(1))
    assert _tracker(ckpt) == stopped < ITERS
    for it, loss in losses(out).items():
        assert loss == pytest.approx(reference[it], rel=1e-5), f"iteration {it}"


def test_exit_duration_saves_and_stops(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    start_time = time.monotonic()
    code, out = run(BASE + ["--save", ckpt, "--exit-duration-in-mins", "0.0001", "--train-iters", "100000"])
    assert code == 0, out
    assert re.search(r"--exit-duration-in-mins 0.0001 reached: stopping at iteration 1 after saving it", out), out
    assert _tracker(ckpt) == 1 and time.monotonic() - start_time < 120


def test_save_interval_minutes_saves_on_the_clock(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    code, out = run(BASE + ["--save", ckpt, "--save-interval-minutes", "0.00001", "--train-iters", "3"])
    assert code == 0, out
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]
