"""--log-straggler: each rank's matmul probe gathered at every log interval; a rank slower than the median by
the factor for the set number of intervals in a row is named with its host."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from megatron.training.stragglers import StragglerConfig, StragglerDetector
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess


def _with_probe_times(rank, world_size, per_interval):
    """Rank r's probe takes per_interval[k][r] seconds at interval k."""
    calls = iter(per_interval)
    detector = StragglerDetector(StragglerConfig(factor=1.25, intervals=2), torch.device("cpu"),
                                 probe=lambda device: next(calls)[rank])
    return [detector.check() for _ in per_interval]


def test_a_rank_slow_for_the_set_intervals_in_a_row_is_named_on_every_rank():
    per_interval = [(1.0, 1.0, 2.0), (1.0, 1.0, 2.0), (1.0, 1.0, 1.0), (1.0, 2.0, 2.0), (1.0, 2.0, 2.0)]
    outs = run_distributed(_with_probe_times, 3, per_interval)
    assert outs[0] == outs[1] == outs[2]  # the same lines on every rank: whichever logs prints them
    named = [[line for line in lines if line.startswith("straggler: ")] for lines in outs[0]]
    host = socket.gethostname()
    assert named[0] == [] and named[2] == [] and named[3] == []  # one slow interval is not a straggler
    assert named[1] == [f"straggler: rank 2 ({host}) computes 2.00x slower than the median rank for 2 log intervals "
                        f"in a row (matmul probe 2000.00 ms against 1000.00 ms); every rank waits for it in each "
                        f"collective: check its clocks, temperature and neighbours, or leave its host out"]
    # rank 1 slow twice in a row too; rank 2's streak broke at interval 3. The median is 2.0 then: nobody is slow.
    assert named[4] == []
    assert outs[0][0][0] == ("straggler check: matmul probe 1000.00 ms median, fastest rank 0 1000.00 ms, slowest "
                             "rank 2 2000.00 ms (2.00x the median)")


def _with_step_times(rank, world_size):
    detector = StragglerDetector(StragglerConfig(), torch.device("cpu"), probe=lambda device: 1.0)
    return detector.check(step_seconds=1.0 + rank / 8, waited_seconds=0.5 - rank / 4), detector.check(0.25)


def test_each_rank_step_and_collective_times_are_logged_on_one_line():
    outs = run_distributed(_with_step_times, 2)
    assert outs[0] == outs[1]
    profiled, plain = outs[0]
    assert profiled[1] == ("straggler check: per rank (step s / blocked in collectives s): 0: 1.000/0.500, "
                           "1: 1.125/0.250")
    assert plain[1] == "straggler check: per rank (step s): 0: 0.250, 1: 0.250"


def _throttled(rank, world_size, pid_file):
    if rank == 1:
        pid_file.write_text(str(os.getpid()))
    detector = StragglerDetector(StragglerConfig(factor=1.25, intervals=3), torch.device("cpu"))
    return [detector.check() for _ in range(3)]


def _throttle(pid_file, done: threading.Event) -> None:
    """Let the process of ``pid_file`` run a quarter of the time (15 ms stopped, 5 ms running), as a throttled
    device or a noisy neighbour slows a rank; it is left running."""
    while not pid_file.exists() and not done.is_set():
        time.sleep(0.005)
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    try:
        while pid is not None and not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.015)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.005)
    except ProcessLookupError:
        pass
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_a_throttled_rank_is_named_after_three_intervals(tmp_path):
    pid_file, done = tmp_path / "rank1.pid", threading.Event()
    throttler = threading.Thread(target=_throttle, args=(pid_file, done))
    throttler.start()
    try:
        lines = run_distributed(_throttled, 2, pid_file)[0]
    finally:
        done.set()
        throttler.join()
    assert not any(line.startswith("straggler: ") for line in lines[0] + lines[1]), lines
    assert [line.split(" computes")[0] for line in lines[2] if line.startswith("straggler: ")] == \
        [f"straggler: rank 1 ({socket.gethostname()})"], lines
