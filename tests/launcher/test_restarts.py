"""ptm-launch --max_restarts on one machine: a rank killed mid-run, a torchrun killed, restarts running out.

The strongest check trains the real pretrain_gpt.py (tiny GPT, DP=2, dropout on) with --save/--load: rank 1
is killed with SIGKILL after the checkpoint of iteration 6, every rank restarts from it, and the losses of
every iteration equal those of the uninterrupted run.
"""
from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from tests.launcher.launch_utils import (
    STANDIN,
    LiveLauncher,
    gpt_losses_by_iteration,
    run_launcher,
    tiny_gpt_args,
    tiny_gpt_losses,
)
from tests.launcher.standin_train import reference_losses

pytestmark = pytest.mark.multiprocess

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def test_killed_rank_restarts_every_rank_from_the_checkpoint_with_the_uninterrupted_losses(tmp_path):
    expected = tiny_gpt_losses()
    ckpt = tmp_path / "ckpt"
    live = LiveLauncher("--num_gpus", "2", "--max_restarts", "1", "pretrain_gpt.py", *tiny_gpt_args(),
                        "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3", env=CPU_ONLY)
    live.wait_for(re.compile(r"iteration\s+7/"), timeout=300)
    victim = live.workers()[1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    restart = live.wait_for("ptm-launch: restart 1 of 1:", timeout=120)
    resumed = int(re.search(r"from iteration (\d+)", live.lines[restart])[1])
    first_again = live.wait_for(re.compile(rf"iteration\s+{resumed + 1}/"), timeout=300, after=restart)
    assert live.finish(timeout=300) == 0, live.output
    seconds = live.times[first_again] - killed_at
    print(f"\nrank 1 killed -> iteration {resumed + 1} trained again after {seconds:.1f} s")

    out = live.output
    assert live.lines[restart].rstrip() == (
        f"ptm-launch: restart 1 of 1: rank 1 (localhost, local rank 1) was killed by SIGKILL; restarting all ranks "
        f"from iteration {resumed} ({ckpt}/latest_checkpointed_iteration.txt); 0 restart(s) left")
    assert resumed >= 6 and resumed % 3 == 0
    assert "ptm-launch: restart 1: all 1 node(s) rejoined" in out
    assert f"loaded checkpoint {ckpt}/iter_{resumed:07d}" in out
    assert "another rank failed" not in out and "Traceback" not in out  # rank 0 only stopped: kept out
    assert gpt_losses_by_iteration(live.lines[first_again:]) == {i: expected[i] for i in range(resumed + 1, 13)}
    assert gpt_losses_by_iteration(out) == expected
    assert seconds < 240


def test_restarts_that_run_out_fail_the_job_with_the_last_cause():
    result = run_launcher("--num_gpus", "2", "--max_restarts", "1", STANDIN, "--fail-rank", "1", "--fail-step", "1",
                          env=CPU_ONLY, timeout=300)
    # The stand-in raises and leaves through the interpreter's teardown, where gloo's threads can abort it
    # after its error was printed, or abort rank 0 first (then torchrun reports only rank 0 and stops rank 1):
    # every way, that rank and its error are the cause.
    out = result.stdout
    assert result.returncode in (1, 128 + signal.SIGABRT), out
    ended = (r"rank 1 \(localhost, local rank 1\) (exited with code 1|was killed by SIGABRT"
             r"|failed \(torchrun stopped it before its exit\))")
    assert re.search(f"ptm-launch: restart 1 of 1: {ended}: RuntimeError: injected failure on rank 1 at step 1; "
                     r"restarting all ranks from its latest checkpoint; 0 restart\(s\) left\n", out), out
    assert out.count("allreduce: 3.0") == 2, out  # ran twice
    assert out.count("[rank1]: RuntimeError: injected failure on rank 1 at step 1") == 2, out
    assert "Connection closed by peer" not in out and "ChildFailedError" not in out, out
    # Rank 0 is counted if it printed its lost connection before torchrun stopped it.
    assert re.fullmatch(f"ptm-launch: job failed: {ended} " + r"\(its error is above; (1 other rank\(s\) stopped "
                        r"because of it; )?1 of 1 restart\(s\) used\)", out.rstrip().splitlines()[-1]), out


def test_a_killed_torchrun_is_started_again():
    # 1 s a step: the workers are still running when the test, on a loaded machine, finds and kills torchrun.
    live = LiveLauncher("--num_gpus", "2", "--max_restarts", "1", STANDIN, "--steps", "6", "--sleep", "1",
                        env=CPU_ONLY)
    live.wait_for("step 1 loss", timeout=120)
    (torchrun,) = live.torchruns()
    workers = list(live.workers().values())
    torchrun.kill()
    assert live.finish(timeout=240) == 0, live.output
    out = live.output
    assert ("ptm-launch: node 0 (localhost) lost its torchrun (killed by SIGKILL, exit code 137); starting its "
            "torchrun again") in out
    assert "ptm-launch: restart 1: all 1 node(s) rejoined" in out
    assert out.count("allreduce: 3.0") == 2
    losses = {int(step): float(loss) for step, loss in re.findall(r"step (\d+) loss (\S+)", out)}  # the last run's
    assert [losses[s] for s in range(6)] == pytest.approx(reference_losses(world=2, steps=6), rel=1e-5)
    assert not any(psutil.pid_exists(pid) for pid in workers)  # the dead torchrun's workers were cleaned up


def test_a_frozen_rank_ends_the_round_after_the_training_timeout_and_the_job_goes_on(tmp_path):
    """SIGSTOP on rank 1 in the middle of training: nothing resets a connection, rank 0's next collective just
    waits. It times out after --train-timeout-seconds, rank 0 names rank 1 as the rank that stopped answering (its
    heartbeat stopped) and the collective it waited in, torchrun restarts every rank (the frozen one is killed),
    and the job finishes with the uninterrupted run's losses."""
    expected = tiny_gpt_losses()
    ckpt = tmp_path / "ckpt"
    # Frozen between checkpoints (saved at 6 and 12): a checkpoint's barrier waits --distributed-timeout-minutes
    # instead, made short here too in case a slow machine lets the ranks reach it first.
    live = LiveLauncher("--num_gpus", "2", "--max_restarts", "1", "pretrain_gpt.py", *tiny_gpt_args(),
                        "--train-timeout-seconds", "3", "--distributed-timeout-minutes", "1", "--save", str(ckpt),
                        "--load", str(ckpt), "--save-interval", "6", env=CPU_ONLY)
    try:
        live.wait_for(re.compile(r"iteration\s+2/"), timeout=300)
        rank1 = psutil.Process(live.workers()[1])
        live.wait_for(re.compile(r"iteration\s+7/"), timeout=300)
        rank1.suspend()
        restart = live.wait_for("ptm-launch: restart 1 of 1:", timeout=120)
        assert live.finish(timeout=300) == 0, live.output
    finally:
        if live.proc.poll() is None:
            live.proc.kill()
    assert re.search(r"ptm-launch: restart 1 of 1: rank 0 \(localhost, local rank 0\) exited with code 1: rank 0: "
                     r"stopping: rank 1 stopped answering \(\w+: \w+ at [\w/]+\.py:\d+ timed out; no heartbeat from "
                     r"it for 5 s\); restarting all ranks from iteration \d+", live.lines[restart]), live.lines[restart]
    assert gpt_losses_by_iteration(live.output) == expected
