"""Preemption: SIGTERM / SIGUSR1 with --exit-signal-handler, --exit-duration-in-mins, --save-interval-minutes."""
from __future__ import annotations

import json
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


def test_copies_of_one_signal_are_one_request_and_a_later_signal_stops_at_once():
    """Slurm signals every process and the launcher passes the signal on too: copies within SAME_REQUEST_S are
    the same preemption; a signal after that stops the process at once."""
    script = ("import os, signal, sys, time\n"
              "import megatron.training.exit_conditions as ec\n"
              "ec.SAME_REQUEST_S = 1.0\n"
              "handler = ec.ExitSignal()\n"
              "for _ in range(3):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(0.1)\n"
              "assert handler.received == signal.SIGTERM\n"
              "print('copies recorded once', flush=True)\n"
              "time.sleep(1.0)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(10)\n"
              "print('still running')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout.strip() == "copies recorded once"


WORKERS_UNDER_SIGTERM = """
import json, os, signal, subprocess, psutil, torch
def deaf(pid):  # the trainer's signals that never reach the process: blocked or ignored
    status = dict(line.split(':', 1) for line in open(f'/proc/{pid}/status'))
    mask = int(status['SigBlk'], 16) | int(status['SigIgn'], 16)
    return sorted(s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) if mask >> (s - 1) & 1)
signal.signal(signal.SIGTERM, lambda *a: print('handled', flush=True))
before = deaf(os.getpid())  # a shell's background job starts with SIGINT ignored: what it inherited stays
from megatron.data.data_samplers import build_pretraining_data_loader
batches = iter(build_pretraining_data_loader(torch.utils.data.TensorDataset(torch.arange(64)), 0, 2, 0, 1, 1))
next(batches)
print(json.dumps([before, deaf(os.getpid()), [deaf(p.pid) for p in psutil.Process().children(recursive=True)]]),
      flush=True)
subprocess.run(['kill', '-s', 'TERM', '--', f'-{os.getpgid(0)}'])  # from another process, as Slurm's
print(sum(1 for _ in batches), flush=True)
"""


def test_data_loader_workers_and_their_forkserver_never_get_the_trainers_signals():
    """They and the forkserver's resource tracker start with SIGTERM, SIGINT and SIGUSR1 blocked: a signal to the
    whole process group (as Slurm sends it) reaches only the trainer's handler, and the loader goes on; the
    trainer's own mask is left as it was."""
    proc = subprocess.run([sys.executable, "-c", WORKERS_UNDER_SIGTERM], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=120, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    masks, *rest = proc.stdout.splitlines()
    before, trainer, helpers = json.loads(masks)
    assert trainer == before and len(helpers) >= 3, proc.stdout  # the resource tracker, the forkserver, the worker
    assert all(h == ["SIGINT", "SIGTERM", "SIGUSR1"] for h in helpers), proc.stdout
    assert rest == ["handled", "31"], proc.stdout + proc.stderr


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
                                        "latest_checkpointed_iteration.txt", "logs"]
