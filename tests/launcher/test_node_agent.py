"""The per-node agent: exit status passthrough, orphan clean-up, stopping when the launcher goes away."""
from __future__ import annotations

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
    assert "stopping torchrun: the launcher closed the connection" in agent.stderr.read()


def test_signal_stops_the_command():
    agent = _agent("--", "sh", "-c", "echo started; exec sleep 1000")
    assert agent.stdout.readline() == "started\n"
    agent.send_signal(signal.SIGHUP)  # as when a terminal or session goes away
    assert agent.wait(timeout=60) == 128 + signal.SIGTERM
    assert "stopping torchrun: got SIGHUP" in agent.stderr.read()


def test_missing_command_is_reported():
    agent = _agent("--", "/nonexistent/torchrun")
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 127 and "cannot start '/nonexistent/torchrun'" in err
