"""Per-node wrapper around torchrun, started by the launcher on every node (over ssh/pdsh, or locally).

It runs the command after ``--`` and makes sure nothing of it outlives the job: when the launcher goes
away (its end of stdin closes, or this process is re-parented because the ssh session or the
launcher died) or a SIGTERM/SIGINT/SIGHUP arrives, it sends SIGTERM to torchrun (which stops its
workers), and after ``--grace`` seconds kills whatever is left. As a child subreaper it also adopts
workers orphaned by a crashed torchrun, so those are cleaned up too. Exit status: the command's.

The launcher runs this file by path, so it imports nothing from this package.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading

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


def _watch_stdin(stop: threading.Event, reasons: list[str]) -> None:
    # The launcher never writes; EOF means it closed the pipe or vanished. A raw read holds no
    # buffer lock, so interpreter shutdown is not blocked by this daemon thread.
    while os.read(sys.stdin.fileno(), 4096):
        pass
    reasons.append("the launcher closed the connection")
    stop.set()


def _watch_parent(parent: int, stop: threading.Event, reasons: list[str]) -> None:
    while not stop.wait(_POLL_S):
        if os.getppid() != parent:
            reasons.append("the launcher (or its ssh session) went away")
            stop.set()


def run(command: list[str], watch_stdin: bool, grace: float, label: str) -> int:
    _become_subreaper()
    stop = threading.Event()
    reasons: list[str] = []

    def on_signal(signum, _frame):
        reasons.append(f"got {signal.Signals(signum).name}")
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    threading.Thread(target=_watch_parent, args=(os.getppid(), stop, reasons), daemon=True).start()
    if watch_stdin:
        threading.Thread(target=_watch_stdin, args=(stop, reasons), daemon=True).start()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as exc:
        _log(label, f"cannot start {command[0]!r}: {exc}")
        return 127
    while proc.poll() is None and not stop.wait(_POLL_S):
        pass
    if proc.poll() is None:
        _log(label, f"stopping torchrun: {reasons[0] if reasons else 'stop requested'}")
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _log(label, f"torchrun still running after {grace:.0f}s; killing it")
            proc.kill()
            proc.wait()
    elif proc.returncode < 0:
        _log(label, f"torchrun was killed by {signal.Signals(-proc.returncode).name}; stopping its workers")
    _kill_descendants(grace=5.0)  # workers a crashed torchrun left behind, or stragglers after a kill
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--watch-stdin", action="store_true", help="stop when stdin reaches EOF")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--label", default="node", help="name used in this agent's messages")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    return run(command, args.watch_stdin, args.grace, args.label)


if __name__ == "__main__":
    sys.exit(main())
