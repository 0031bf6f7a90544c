"""ptm-launch without a hostfile: torchrun on this machine, failure reports, Ctrl-C, hostfile errors."""
from __future__ import annotations

import re
import signal

import psutil
import pytest

from tests.launcher.launch_utils import STANDIN, LiveLauncher, run_launcher, standin_report
from tests.launcher.standin_train import reference_losses

pytestmark = pytest.mark.multiprocess

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # --num_gpus means CPU processes, also on a GPU machine
TAG = "a b; touch pwned $(id) `id` 'q' \"dq\""


def test_two_local_processes_match_single_process_reference(tmp_path):
    env_file = tmp_path / "ptm_env"
    env_file.write_text("PTM_TEST_MARKER='from the env file'\n")
    result = run_launcher("--num_gpus", "2", STANDIN, "--tag", TAG,
                          env={**CPU_ONLY, "PTM_ENV_FILE": str(env_file)})
    assert result.returncode == 0, result.stdout
    report = standin_report(result.stdout)
    assert report["allreduce"] == 1.0 + 2.0
    assert [(r["rank"], r["local_rank"], r["env"]) for r in report["ranks"]] == \
        [(0, 0, "from the env file"), (1, 1, "from the env file")]
    assert report["tag"] == TAG
    assert report["losses"] == pytest.approx(reference_losses(world=2, steps=5), rel=1e-5)


def test_failing_rank_fails_the_job_with_its_error():
    result = run_launcher("--num_gpus", "2", STANDIN, "--fail-rank", "1", "--fail-step", "1", env=CPU_ONLY)
    out = result.stdout
    # 1, or SIGABRT when gloo's threads abort the rank in the interpreter's teardown after its error was printed;
    # when they abort rank 0 first, torchrun reports only rank 0 and stops rank 1, known by its error line
    assert result.returncode in (1, 128 + signal.SIGABRT), out
    # the failing rank's own traceback once; rank 0's "Connection closed by peer" and torchrun's
    # ChildFailedError traceback and summary are kept out, and the last line names the cause
    assert out.count("RuntimeError: injected failure on rank 1 at step 1") == 1, out
    assert "Connection closed by peer" not in out and "ChildFailedError" not in out and "Root Cause" not in out
    # rank 0 is counted if it printed its lost connection before torchrun stopped it
    ended = (r"rank 1 \(localhost, local rank 1\) (exited with code 1|was killed by SIGABRT"
             r"|failed \(torchrun stopped it before its exit\))")
    assert re.fullmatch(f"ptm-launch: job failed: {ended} " + r"\(its error is above(; 1 other rank\(s\) stopped "
                        r"because of it)?\)", out.rstrip().splitlines()[-1]), out
    assert "step 1 loss" in out and "step 2 loss" not in out


def test_ctrl_c_stops_every_process():
    """Ctrl-C is passed on as a preemption; a script without a SIGTERM handler dies of it: 128 + SIGINT."""
    live = LiveLauncher("--num_gpus", "2", STANDIN, "--steps", "10000", "--sleep", "0.2", env=CPU_ONLY)
    live.wait_for("step 1 loss", timeout=90)
    workers = [psutil.Process(r["pid"]) for r in standin_report(live.output)["ranks"]]
    live.proc.send_signal(signal.SIGINT)
    assert live.finish(timeout=60) == 128 + signal.SIGINT, live.output
    assert "ptm-launch: SIGINT received: asking every rank to finish its step, save a checkpoint and exit" \
        in live.output
    assert "the launcher was preempted: asking torchrun's ranks to finish their step, save and exit" in live.output
    assert "ptm-launch: stopped by SIGINT without a clean exit of every rank" in live.output
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers still running after Ctrl-C: {alive}"


@pytest.mark.parametrize("hostfile, args, message", [
    ("node-a slots=2\nnode-a slots=2\n", [], "line 2: duplicate host 'node-a'"),
    ("node-a slots=2\n", ["--exclude", "node-z"], "--exclude names host 'node-z', which is not in the hostfile"),
])
def test_bad_hostfile_is_a_clear_error(tmp_path, hostfile, args, message):
    path = tmp_path / "hostfile"
    path.write_text(hostfile)
    result = run_launcher("--hostfile", str(path), *args, STANDIN, timeout=60)
    assert result.returncode == 2
    assert result.stdout.startswith("ptm-launch: error: ") and message in result.stdout, result.stdout
