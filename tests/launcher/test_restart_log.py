"""Which failure is the cause, the restart budget and its log lines, and where a restarted job resumes."""
from __future__ import annotations

import signal

import pytest

from ptm_launch.checkpoints import CheckpointTracker, load_dir_of
from ptm_launch.commands import NodeSpec
from ptm_launch.node_output import CauseLine, RestartRequested, WorkerFailed
from ptm_launch.restarts import CAUSE_LINE_WAIT_S, Failure, Restarts, cause_of
from ptm_launch.supervisor import Supervisor


def _rank(t, exitcode, local_rank=0, rank=None, line=None, node=0, host="h0"):
    return Failure(node, host, t, exitcode, local_rank, rank, line)


def test_the_cause_beats_its_consequences_whatever_the_order():
    killed = _rank(2.0, -signal.SIGKILL, 1, 3, node=1, host="h1")
    peer_lost = _rank(1.0, 1, 0, 0)  # exited 1 first: its peer was gone
    stopped = _rank(1.5, -signal.SIGTERM, 1, 1)  # torchrun stopped it
    assert cause_of([peer_lost, stopped, killed]) is killed
    bad_input = _rank(3.0, 2, 0, 2, line="pretrain_gpt.py: error: bad")
    assert cause_of([peer_lost, bad_input]) is bad_input
    stated = _rank(4.0, 1, 0, 5, line="RuntimeError: CUDA out of memory")
    assert cause_of([peer_lost, stated]) is stated
    aborted = _rank(0.5, -signal.SIGABRT, 1, 4)  # gloo's thread ended it when its peer left
    assert cause_of([aborted, peer_lost, stated]) is stated
    assert cause_of([aborted, peer_lost]) is aborted
    raised_then_aborted = _rank(3.5, -signal.SIGABRT, 1, 6, line="RuntimeError: x")  # aborted in its teardown
    assert cause_of([aborted, peer_lost, raised_then_aborted]) is raised_then_aborted
    node = Failure(1, "h1", 5.0, 137)
    assert cause_of([killed, node]) is node
    assert cause_of([_rank(2.0, 1), _rank(1.0, 1, rank=7)]).global_rank == 7  # ties: the earliest
    assert cause_of([]) is None


@pytest.mark.parametrize("failure, text, status", [
    (_rank(0, -9, 1, 3, host="h1"), "rank 3 (h1, local rank 1) was killed by SIGKILL", 137),
    (_rank(0, 2, 0, 0, host="h0"), "rank 0 (h0, local rank 0) exited with code 2", 2),
    (_rank(0, 1, 1, None, host="h0"), "local rank 1 (h0) exited with code 1", 1),
    (Failure(1, "h1", 0, 137), "node 1 (h1) lost its torchrun (killed by SIGKILL, exit code 137)", 137),
    (Failure(1, "h1", 0, 255), "node 1 (h1) lost its connection (ssh exit code 255", 255),
])
def test_failures_are_described_with_their_exit_status(failure, text, status):
    assert failure.describe().startswith(text)
    assert failure.exit_status() == status


def test_a_restart_is_announced_once_with_cause_resume_point_and_budget(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40\n")
    restarts = Restarts(2, CheckpointTracker(tmp_path))
    assert restarts.begin(10.0) and restarts.used == 1 and restarts.left == 1
    restarts.add(_rank(10.0, 1, 0, 0))
    restarts.add(_rank(10.1, -9, 1, 3, node=1, host="h1"))
    assert restarts.begin(10.2)  # the other node's report belongs to the same restart
    assert restarts.used == 1
    assert restarts.messages(10.5) == []  # the other nodes' reports may still be on their way
    (line,) = restarts.messages(12.0)
    assert line == (f"restart 1 of 2: rank 3 (h1, local rank 1) was killed by SIGKILL; restarting all ranks from "
                    f"iteration 40 ({tmp_path}/latest_checkpointed_iteration.txt); 1 restart(s) left")
    assert restarts.messages(13.0) == []
    assert restarts.rejoined(0, 2, 14.0) == []
    assert restarts.rejoined(1, 2, 15.5) == ["restart 1: all 2 node(s) rejoined 5.5 s after the failure; "
                                             "training resumes"]
    assert restarts.pending is None and restarts.round_start == 15.5
    assert restarts.begin(20.0) and restarts.left == 0
    restarts.rejoined(0, 1, 21.0)
    assert not restarts.begin(30.0)  # spent: torchrun gives up and the job fails with that failure


def test_a_quick_rejoin_announces_before_reporting_it():
    restarts = Restarts(1)
    restarts.begin(0.0)
    restarts.add(_rank(0.0, 2, 0, 0, line="pretrain_gpt.py: error: x"))
    lines = restarts.rejoined(0, 1, 0.4)
    assert lines[0] == ("restart 1 of 1: rank 0 (h0, local rank 0) exited with code 2: pretrain_gpt.py: error: x; "
                        "restarting all ranks from its latest checkpoint; 0 restart(s) left")
    assert lines[1].startswith("restart 1: all 1 node(s) rejoined 0.4 s after")


def test_a_cause_without_its_error_line_is_announced_once_the_line_arrives_or_after_a_while():
    restarts = Restarts(2)
    restarts.begin(0.0)
    unstated = _rank(0.0, 1, 1, 1)
    restarts.add(unstated)
    assert restarts.messages(2.0) == []  # torchrun's report of the exit came before the rank's own error line
    restarts.replace(unstated, _rank(0.0, 1, 1, 1, line="RuntimeError: late"))
    (line,) = restarts.messages(2.1)
    assert line.startswith("restart 1 of 2: rank 1 (h0, local rank 1) exited with code 1: RuntimeError: late;")
    restarts.rejoined(0, 1, 3.0)
    restarts.begin(10.0)
    restarts.add(_rank(10.0, 1, 0, 0))  # a rank that says nothing: announced without a line in the end
    assert restarts.messages(10.0 + CAUSE_LINE_WAIT_S - 0.1) == []
    (line,) = restarts.messages(10.0 + CAUSE_LINE_WAIT_S)
    assert line.startswith("restart 2 of 2: rank 0 (h0, local rank 0) exited with code 1; restarting")


def test_an_error_line_that_arrives_after_its_ranks_exit_names_the_cause():
    supervisor = Supervisor([], stop_timeout=1.0, restarts=Restarts(1))
    node = supervisor._start(NodeSpec("localhost", 0, (0, 1), ("true",)))
    node.global_ranks = (0, 1)
    supervisor.nodes.append(node)
    # rank 1 raised, then aborted in its teardown; rank 0 exited 1 with an error of its own
    for event in (WorkerFailed(1, -signal.SIGABRT, 5.0), RestartRequested(False, 5.0), WorkerFailed(0, 1, 5.1),
                  CauseLine("RuntimeError: injected", 1, 5.3), CauseLine("ValueError: another rank's", 0, 5.4)):
        supervisor._events.put((node, event))
    supervisor._handle_events()
    node.finish_reading()
    assert [f.cause_line for f in supervisor.failures] == ["RuntimeError: injected", "ValueError: another rank's"]
    (line,) = supervisor.restarts.messages(7.0)
    assert line.startswith("restart 1 of 1: rank 1 (localhost, local rank 1) was killed by SIGABRT: RuntimeError: "
                           "injected;")


def test_a_rank_that_printed_its_error_is_the_cause_when_torchrun_reports_only_its_aborted_peer():
    supervisor = Supervisor([], stop_timeout=1.0, restarts=Restarts(1))
    node = supervisor._start(NodeSpec("localhost", 0, (0, 1), ("true",)))
    node.global_ranks = (0, 1)
    supervisor.nodes.append(node)
    # rank 1 raised; gloo's thread aborted rank 0 first, and torchrun reported only rank 0 and stopped rank 1
    for event in (CauseLine("RuntimeError: injected", 1, 5.0), WorkerFailed(0, -signal.SIGABRT, 5.2),
                  RestartRequested(False, 5.2)):
        supervisor._events.put((node, event))
    supervisor._handle_events()
    node.finish_reading()
    (line,) = supervisor.restarts.messages(7.0)
    assert line.startswith("restart 1 of 1: rank 1 (localhost, local rank 1) failed (torchrun stopped it before its "
                           "exit): RuntimeError: injected;")
    cause = cause_of(supervisor._round_failures())
    assert cause.global_rank == 1 and cause.exit_status() == 1
    # Its exit reported after all: that report replaces the failure known from the line alone.
    supervisor._events.put((node, WorkerFailed(1, 1, 5.3)))
    supervisor._handle_events()
    assert [(f.global_rank, f.exitcode, f.unreported, f.cause_line) for f in supervisor.failures] == [
        (0, -signal.SIGABRT, False, None), (1, 1, False, "RuntimeError: injected")]
    cause = cause_of(supervisor.restarts.pending.failures)
    assert cause.describe() == "rank 1 (localhost, local rank 1) exited with code 1"


def test_resume_point_from_the_scripts_load_dir(tmp_path):
    assert load_dir_of(["--save", "a", "--load", "ckpt", "--lr", "1"]) == "ckpt"
    assert load_dir_of(["--load=x", "--load", "y"]) == "y" and load_dir_of(["--load"]) is None
    tracker = CheckpointTracker.from_args(["--load", "ckpt"], tmp_path)
    assert tracker.resume_point() == f"from the start (no checkpoint in {tmp_path / 'ckpt'} yet)"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("release")
    tracker_file = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    assert tracker.resume_point() == f"from the 'release' checkpoint ({tracker_file})"
    assert CheckpointTracker.from_args([], tmp_path).resume_point() == "from its latest checkpoint"
    assert "--save DIR --load DIR" in CheckpointTracker(None).resume_note()


def test_a_node_that_keeps_failing_before_the_job_is_back_spends_the_budget():
    restarts = Restarts(3)
    assert restarts.begin(0.0)  # a rank's failure was reported first
    assert restarts.begin_node(1, 0.5) and restarts.used == 1  # the same failure: its node's torchrun died
    assert restarts.begin_node(0, 0.6) and restarts.used == 1
    assert restarts.begin_node(1, 5.0) and restarts.used == 2  # node 1 failed again (its host is gone)
    assert restarts.begin_node(1, 9.0) and restarts.used == 3
    assert not restarts.begin_node(1, 13.0)
