"""The per-node agent: exit status passthrough, orphan clean-up, stopping when the launcher goes away or the job
is preempted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from ptm_launch.commands import AGENT_PATH

pytestmark = pytest.mark.multiprocess


def _agent(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, AGENT_PATH, "--grace", "5", "--label", "test", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_exit_status_is_passed_through_and_orphans_are_killed():
    # The command leaves a background child behind and exits 3, like a crashed torchrun leaves workers.
    agent = _agent("--", "sh", "-c", "sleep 1000 & echo $!; exit 3")
    out, err = agent.communicate(timeout=60)
    assert agent.returncode == 3, err
    orphan = int(out.split()[0])
    assert not psutil.pid_exists(orphan), "the orphaned child outlived the agent"


def test_stdin_eof_stops_the_command():
    agent = _agent("--watch-stdin", "--", "sh", "-c", "echo started; exec sleep 1000", stdin=subprocess.PIPE)
    assert agent.stdout.readline() == "started\n"
    agent.stdin.close()  # what the launcher does to stop a node
    assert agent.wait(timeout=60) == 128 + signal.SIGTERM  # the command got SIGTERM
    assert "the launcher closed the connection: asking torchrun's ranks to stop (up to 5s)" in agent.stderr.read()


def test_signal_stops_the_command():
    agent = _agent("--", "sh", "-c", "echo started; exec sleep 1000")
    assert agent.stdout.readline() == "started\n"
    agent.send_signal(signal.SIGHUP)  # as when a terminal or session goes away
    assert agent.wait(timeout=60) == 128 + signal.SIGTERM
    assert "got SIGHUP: asking torchrun's ranks to finish their step, save and exit" in agent.stderr.read()


# A stand-in torchrun whose workers save on SIGTERM: it reports each signal and exits 0 two seconds later.
SAVES_ON_SIGTERM = ("import signal, sys, time\n"
                    "got = []\n"
                    "signal.signal(signal.SIGTERM, lambda s, f: got.append(time.monotonic()))\n"
                    "print('started', flush=True)\n"
                    "while not got or time.monotonic() - got[0] < 2: time.sleep(0.05)\n"
                    "print(f'signals {len(got)}', flush=True)\n")


def test_preempt_line_lets_the_command_finish_and_exit_zero():
    """The launcher's ``preempt`` line: one SIGTERM, then the command gets the preemption grace, not --grace."""
    agent = _agent("--watch-stdin", "--preempt-grace", "60", "--grace", "0.5", "--", sys.executable, "-c",
                   SAVES_ON_SIGTERM, stdin=subprocess.PIPE)
    assert agent.stdout.readline() == "started\n"
    agent.stdin.write("preempt\n")
    agent.stdin.flush()
    assert agent.wait(timeout=60) == 0, agent.stderr.read()
    assert agent.stdout.read() == "signals 1\n"
    assert "the launcher was preempted: asking torchrun's ranks to finish their step, save and exit (up to 60s)" \
        in agent.stderr.read()


# A stand-in torchrun: starts a "rank" and, each time that rank dies, reports it and starts another (a restart).
RESTARTS_ITS_RANK = ("import subprocess, sys\n"
                     "for attempt in range(2):\n"
                     "    rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'])\n"
                     "    print(f'rank {rank.pid}', flush=True)\n"
                     "    print(f'rank exited {rank.wait()}', flush=True)\n")


def test_restart_line_kills_the_ranks_and_leaves_torchrun_running():
    """Another node left an elastic job: the ranks are killed (SIGKILL: they must not try to save with a peer
    that is gone); torchrun itself stays, to start them again."""
    agent = _agent("--watch-stdin", "--", sys.executable, "-c", RESTARTS_ITS_RANK, stdin=subprocess.PIPE)
    first = agent.stdout.readline()
    assert first.startswith("rank ")
    agent.stdin.write("restart\n")
    agent.stdin.flush()
    assert agent.stdout.readline() == f"rank exited {-signal.SIGKILL}\n"
    second = agent.stdout.readline()
    assert second.startswith("rank ") and second != first  # started again: the agent did not stop the command
    os.kill(int(second.split()[1]), signal.SIGTERM)
    assert agent.wait(timeout=60) == 0
    assert "another node left the job: stopping torchrun's ranks; torchrun restarts them in a new round" \
        in agent.stderr.read()


def test_every_process_signalled_at_once_is_one_preemption():
    """Slurm and Kubernetes signal the agent and torchrun together: nothing escalates, the command exits 0."""
    agent = _agent("--", sys.executable, "-c", SAVES_ON_SIGTERM, start_new_session=True)
    assert agent.stdout.readline() == "started\n"
    for _ in range(3):  # three copies, as several paths deliver
        os.killpg(agent.pid, signal.SIGTERM)
    assert agent.wait(timeout=60) == 0, agent.stderr.read()
    assert agent.stdout.read().startswith("signals ")
    assert "killing" not in agent.stderr.read()


def test_command_still_running_after_the_grace_is_killed():
    agent = _agent("--preempt-grace", "1", "--", sys.executable, "-c",
                   "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('started', flush=True); "
                   "time.sleep(1000)")
    assert agent.stdout.readline() == "started\n"
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 128 + signal.SIGKILL
    assert "torchrun still running after the grace period; killing it" in agent.stderr.read()


def test_missing_command_is_reported():
    agent = _agent("--", "/nonexistent/torchrun")
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 127 and "cannot start '/nonexistent/torchrun'" in err
