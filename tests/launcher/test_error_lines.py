"""The first cause of a failed run, once, and its exit code: megatron/training/errors.py in the trainer, under plain
torchrun and under ptm-launch (which exits with the cause's code instead of torchrun's 1)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from megatron.training import errors
from megatron.training.arguments import ConfigError
from tests.data.common import make_dataset
from tests.dist_utils import TORCHRUN
from tests.launcher.launch_utils import REPO, LiveLauncher, run_launcher
from tests.training.parallel_harness import TINY_GPT
from zero_cache import SSDTierError

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _real_data_args(prefix) -> list[str]:
    args = [a for a in TINY_GPT if a != "--mock-data"]
    return [*args, "--data-path", str(prefix)]


def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        errors.run_trainer(lambda: (_ for _ in ()).throw(SSDTierError("SSD tier: nvme_path '/x' is read-only;\nfix")))
    assert exc.value.code == 2
    assert capsys.readouterr().err == "pretrain_gpt.py: error: SSD tier: nvme_path '/x' is read-only; fix\n"
    monkeypatch.setenv("RANK", "3")  # before the process group exists every rank has the same error: rank 0 says it
    with pytest.raises(SystemExit):
        errors.run_trainer(lambda: (_ for _ in ()).throw(ConfigError("--bad")))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("exc, other_rank", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7048"), True),
    (RuntimeError("Timed out waiting 60000ms for recv operation to complete"), True),
    (ConnectionResetError("Connection reset by peer"), True),
    (RuntimeError("CUDA out of memory"), False),
    (TypeError("'NoneType' object is not iterable"), False),
])
def test_a_rank_stopped_by_another_ones_failure_says_so(exc, other_rank, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(errors, "OTHER_RANK_EXIT_DELAY_S", 0.0)
    assert errors.is_other_rank_failure(exc) == other_rank

    def fail():
        raise exc
    if other_rank:
        with pytest.raises(SystemExit) as stopped:
            errors.run_trainer(fail)
        assert stopped.value.code == 1
        assert capsys.readouterr().err == f"rank 5: stopping: another rank failed ({type(exc).__name__})\n"
    else:
        with pytest.raises(type(exc)):  # a bug of this rank: its traceback is the information
            errors.run_trainer(fail)


_CLEAN_EXIT = """
import sys
import torch.distributed as dist
from megatron.training import errors

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
destroy = dist.destroy_process_group

def recorded():
    print("destroyed", flush=True)
    destroy()

dist.destroy_process_group = recorded
if sys.argv[1] == "returns":
    errors.exit_with(lambda: None)
errors.exit_with(lambda: sys.exit(0))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["returns", "exits-0"])
def test_a_run_that_succeeds_destroys_its_process_group_before_exiting(how):
    """Left to the interpreter's teardown, gloo's threads can abort a finished rank (SIGABRT)."""
    proc = subprocess.run([sys.executable, "-c", _CLEAN_EXIT, how], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["destroyed"]


@pytest.mark.multiprocess
def test_empty_dataset_is_one_line_and_exit_2_under_torchrun_and_ptm_launch(tmp_path):
    """Both ranks hit the same error: printed once. torchrun exits 1 whatever the cause; ptm-launch exits 2."""
    make_dataset(tmp_path / "empty", [])
    line = f"pretrain_gpt.py: error: {tmp_path}/empty.bin/.idx holds no documents"
    plain = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py",
                            *_real_data_args(tmp_path / "empty")], cwd=REPO, env={**os.environ, **CPU_ONLY},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert plain.returncode == 1, plain.stdout
    assert plain.stdout.count(line) == 1, plain.stdout
    assert "[rank0]: Traceback" not in plain.stdout and "[rank1]: Traceback" not in plain.stdout
    assert "TypeError" not in plain.stdout

    launched = run_launcher("--num_gpus", "2", "pretrain_gpt.py", *_real_data_args(tmp_path / "empty"), env=CPU_ONLY,
                            timeout=300)
    out = launched.stdout
    assert launched.returncode == 2, out
    assert out.count(line) == 1 and "Traceback" not in out and "ChildFailedError" not in out, out
    # The other rank reaches the same error, or is stopped by this one's exit first (then it is counted).
    assert re.fullmatch(r"ptm-launch: job failed: rank [01] \(localhost, local rank [01]\) exited with code 2 "
                        r"\(its error is above(; 1 other rank\(s\) stopped because of it)?\)",
                        out.rstrip().splitlines()[-1]), out

    # With restarts the job ends all the same: bad input would fail every restart the same way.
    restarting = run_launcher("--num_gpus", "2", "--max_restarts", "2", "pretrain_gpt.py",
                              *_real_data_args(tmp_path / "empty"), env=CPU_ONLY, timeout=300)
    out = restarting.stdout
    assert restarting.returncode == 2, out
    # With restarts the job's store can go with the first rank to exit: a rank that then cannot ask whether the
    # error was reported prints it too (errors.py reports rather than stay silent).
    assert out.count(line) in (1, 2) and "restart 1" not in out, out
    # The other rank may be stopped by this one's exit before it reaches the same error: counted if so.
    assert re.search(r"exited with code 2 \(its error is above; (1 other rank\(s\) stopped because of it; )?exit "
                     r"code 2 is bad input: not restarted, it would fail the same way\)$", out.rstrip()), out


@pytest.mark.multiprocess
def test_a_killed_rank_under_plain_torchrun_and_ptm_launch():
    """The surviving rank says in one line why it stops; ptm-launch names the killed rank and exits 128 + 9."""
    args = list(TINY_GPT)
    args[args.index("--train-iters") + 1] = "100000"
    args[args.index("--log-interval") + 1] = "1"
    live = LiveLauncher("--num_gpus", "2", "pretrain_gpt.py", *args, env=CPU_ONLY)
    live.wait_for(re.compile(r"iteration\s+3/"), timeout=300)
    workers = live.workers()
    os.kill(workers[1], signal.SIGKILL)
    assert live.finish(timeout=120) == 128 + signal.SIGKILL, live.output
    out = live.output
    assert "Traceback" not in out and "Connection closed" not in out and "another rank failed" not in out
    # Rank 0 says it stops because of rank 1 unless torchrun stopped it before it noticed: either is right.
    assert re.fullmatch(r"ptm-launch: job failed: rank 1 \(localhost, local rank 1\) was killed by SIGKILL"
                        r"( \(1 other rank\(s\) stopped because of it\))?", out.rstrip().splitlines()[-1]), out
    assert "ptm-launch: last " in out  # no line of its own: its node's last output lines are shown instead

    torchrun = subprocess.Popen([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py", *args],
                                cwd=REPO, env={**os.environ, **CPU_ONLY}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for output_line in torchrun.stdout:
            lines.append(output_line)
            if re.search(r"iteration\s+3/", output_line):
                break
        ranks = {int(p.environ().get("RANK", -1)): p.pid for p in psutil.Process(torchrun.pid).children(recursive=True)}
        os.kill(ranks[1], signal.SIGKILL)
        rest, _ = torchrun.communicate(timeout=120)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
    output = "".join(lines) + rest
    assert "rank 0: stopping: another rank failed (" in output, output
    assert "[rank0]: Traceback" not in output

