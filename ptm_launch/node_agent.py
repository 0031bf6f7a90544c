"""Per-node wrapper around torchrun, started by the launcher on every node (over ssh/pdsh, or locally).

It runs the command after ``--`` and makes sure nothing of it outlives the job. Asked to stop, it sends
torchrun one signal (graceful_torchrun.py passes it to the ranks, which finish their step, save and exit 0)
and waits: ``--preempt-grace`` seconds when the job is preempted (a SIGTERM/SIGINT/SIGHUP/SIGUSR1 here, or the
launcher's ``preempt`` line on stdin), ``--grace`` seconds when the launcher stops the job after a failure or
goes away (its end of stdin closes, or this process is re-parented because the ssh session or the launcher
died). Then it kills whatever is left. Further signals change nothing: Slurm and Kubernetes signal every
process, so torchrun and the ranks have them already. The launcher's ``restart`` line (another node left an
elastic job) kills torchrun's ranks, and torchrun restarts them in a new rendezvous round. As a child
subreaper it also adopts workers orphaned by a crashed torchrun, so those are cleaned up too. Exit status:
the command's.

The launcher runs this file by path, so it imports nothing from this package.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.2


def _log(label: str, message: str) -> None:
    try:
        print(f"[ptm-launch agent {label}] {message}", file=sys.stderr, flush=True)
    except OSError:  # the launcher's connection is already gone
        pass


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _kill_descendants(grace: float) -> None:
    """SIGTERM every process below this one, then SIGKILL those still alive after ``grace`` seconds."""
    procs = psutil.Process().children(recursive=True)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _kill_workers(torchrun: int) -> None:
    """SIGKILL everything under torchrun (its ranks and theirs): a rank given SIGTERM would try to save, in
    collectives with a node that is gone."""
    try:
        procs = psutil.Process(torchrun).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


PREEMPT_LINE = b"preempt\n"  # what the launcher writes on stdin when it is preempted
RESTART_LINE = b"restart\n"  # ... when another node left the job: torchrun starts a round without it


@dataclass(frozen=True)
class RestartRequest:
    reason: str


@dataclass(frozen=True)
class StopRequest:
    reason: str
    signum: int  # what torchrun gets
    preempt: bool  # the ranks save: --preempt-grace, else --grace


def _watch_stdin(requests: queue.SimpleQueue) -> None:
    # A raw read holds no buffer lock, so interpreter shutdown is not blocked by this daemon thread.
    while data := os.read(sys.stdin.fileno(), 4096):
        if PREEMPT_LINE in data:
            requests.put(StopRequest("the launcher was preempted", signal.SIGTERM, True))
        if RESTART_LINE in data:
            requests.put(RestartRequest("another node left the job"))
    requests.put(StopRequest("the launcher closed the connection", signal.SIGTERM, False))


def _watch_parent(parent: int, requests: queue.SimpleQueue) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    requests.put(StopRequest("the launcher (or its ssh session) went away", signal.SIGTERM, False))


def run(command: list[str], watch_stdin: bool, grace: float, preempt_grace: float, label: str) -> int:
    _become_subreaper()
    requests: queue.SimpleQueue[StopRequest | RestartRequest] = queue.SimpleQueue()  # put() is safe in a signal handler

    def on_signal(signum, _frame):
        passed = signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM
        requests.put(StopRequest(f"got {signal.Signals(signum).name}", passed, True))

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, on_signal)
    threading.Thread(target=_watch_parent, args=(os.getppid(), requests), daemon=True).start()
    if watch_stdin:
        threading.Thread(target=_watch_stdin, args=(requests,), daemon=True).start()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as exc:
        _log(label, f"cannot start {command[0]!r}: {exc}")
        return 127
    deadline = None  # once asked to stop: when torchrun is killed if it is still running
    while proc.poll() is None and (deadline is None or time.monotonic() < deadline):
        try:
            req = requests.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if isinstance(req, RestartRequest):
            if deadline is None:
                _log(label, f"{req.reason}: stopping torchrun's ranks; torchrun restarts them in a new round")
                _kill_workers(proc.pid)
            continue
        wait = preempt_grace if req.preempt else grace
        if deadline is None:
            what = "finish their step, save and exit" if req.preempt else "stop"
            _log(label, f"{req.reason}: asking torchrun's ranks to {what} (up to {wait:.0f}s)")
            proc.send_signal(req.signum)
            deadline = time.monotonic() + wait
        elif not req.preempt:  # the launcher gave up waiting for the save
            deadline = min(deadline, time.monotonic() + wait)
    if proc.poll() is None:
        _log(label, "torchrun still running after the grace period; killing it")
        proc.kill()
        proc.wait()
    elif proc.returncode < 0:
        _log(label, f"torchrun was killed by {signal.Signals(-proc.returncode).name}; stopping its workers")
    _kill_descendants(grace=5.0)  # workers a crashed torchrun left behind, or stragglers after a kill
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--watch-stdin", action="store_true", help="stop when stdin reaches EOF")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds torchrun gets to stop after the launcher stopped the job or went away")
    parser.add_argument("--preempt-grace", type=float, default=300.0,
                        help="seconds torchrun's ranks get to finish their step and save when the job is preempted")
    parser.add_argument("--label", default="node", help="name used in this agent's messages")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    return run(command, args.watch_stdin, args.grace, args.preempt_grace, args.label)


if __name__ == "__main__":
    sys.exit(main())
