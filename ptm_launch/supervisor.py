"""Runs one process per node (ssh/pdsh client or local agent), streams their output, and ends the job.

The job ends when every node exits 0, when one node fails (the others are stopped and the failing
node's last output lines are reported), or on Ctrl-C / SIGTERM (every node is stopped).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TextIO

import psutil

from ptm_launch.commands import NodeSpec

_POLL_S = 0.1
_KILL_WAIT_S = 5.0
_MAX_ERROR_LINES = 10
# Exception lines of a worker ("[rank3]: RuntimeError: ..."); torchrun's own summary error is noise.
_ERROR_RE = re.compile(r"^(?:\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(?:Error|Exception): ")
_NOISE_RE = re.compile(r"ChildFailedError")


@dataclass(frozen=True)
class NodeFailure:
    host: str
    node_rank: int
    returncode: int
    tail: tuple[str, ...]
    errors: tuple[str, ...]  # the first exception lines the node printed (the root cause is usually there)

    def describe(self) -> str:
        code = f"exit code {self.returncode}"
        if self.returncode == 255:
            code += " (ssh's code for a lost connection: the host died, rebooted or became unreachable)"
        elif self.returncode < 0:
            code = f"killed by {signal.Signals(-self.returncode).name}"
        return f"node {self.node_rank} ({self.host}) failed: {code}"


class _Node:
    def __init__(self, spec: NodeSpec, tail_lines: int, out: TextIO, out_lock: threading.Lock):
        self.spec = spec
        env = {**os.environ, **spec.env}
        # Own session: a terminal's Ctrl-C reaches only the launcher, which then stops nodes in order.
        self.proc = subprocess.Popen(spec.argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.errors: list[str] = []
        self._out, self._out_lock = out, out_lock
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.tail.append(line)
            if len(self.errors) < _MAX_ERROR_LINES and _ERROR_RE.match(line) and not _NOISE_RE.search(line):
                self.errors.append(line)
            with self._out_lock:
                try:
                    self._out.write(f"{self.spec.output_prefix}{line}\n")
                    self._out.flush()
                except (OSError, ValueError):  # our own stdout is gone; keep draining so the node never blocks
                    pass

    def close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def signal_tree(self, signum: int) -> None:
        """Signal the client and everything under it (pdsh runs its ssh children in other groups)."""
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                proc.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    def failure(self) -> NodeFailure:
        self.reader.join(timeout=_KILL_WAIT_S)
        return NodeFailure(self.spec.host, self.spec.node_rank, self.proc.returncode, tuple(self.tail),
                           tuple(self.errors))


class Supervisor:
    """Ctrl-C/SIGTERM handlers call ``request_stop``; the work happens in ``run``'s polling loop."""

    def __init__(self, specs: list[NodeSpec], stop_timeout: float, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, tail_lines: int = 30):
        self.specs, self.stop_timeout, self.out, self.err, self.tail_lines = specs, stop_timeout, out, err, tail_lines
        self.nodes: list[_Node] = []
        self._stop_signal: int | None = None
        self._force = False  # a second signal: kill at once

    def request_stop(self, signum: int) -> None:
        """Signal-handler safe: only sets flags."""
        if self._stop_signal is None:
            self._stop_signal = signum
        else:
            self._force = True

    def _say(self, message: str) -> None:
        print(f"ptm-launch: {message}", file=self.err, flush=True)

    def run(self) -> int:
        """Start every node and return the job's exit status."""
        lock = threading.Lock()
        for spec in self.specs:
            try:
                self.nodes.append(_Node(spec, self.tail_lines, self.out, lock))
            except OSError as exc:
                self._say(f"cannot start node {spec.node_rank} ({spec.host}): {exc}")
                self._stop_all()
                return 1
        failure = self._wait()
        if failure is None and self._stop_signal is not None:
            self._say(f"{signal.Signals(self._stop_signal).name} received; stopping all {len(self.nodes)} node(s)")
            self._stop_all()
            return 128 + self._stop_signal
        if failure is None:
            for node in self.nodes:
                node.reader.join(timeout=_KILL_WAIT_S)
            return 0
        self._say(f"{failure.describe()}; stopping the other node(s)")
        self._stop_all()
        self._report(failure)
        if failure.returncode < 0:
            return 128 - failure.returncode
        return failure.returncode if failure.returncode < 256 else 1

    def _report(self, failure: NodeFailure) -> None:
        name = f"node {failure.node_rank} ({failure.host})"
        self._say(f"job failed. Last {len(failure.tail)} output lines of {name}:")
        for line in failure.tail:
            print(f"    {line}", file=self.err)
        if failure.errors:
            self._say(f"errors printed by {name}:")
            for line in failure.errors:
                print(f"    {line}", file=self.err)
        self._say(failure.describe())

    def _wait(self) -> NodeFailure | None:
        """Until all nodes exit 0 (None), one fails (its failure), or a stop is requested (None)."""
        while self._stop_signal is None:
            codes = [node.proc.poll() for node in self.nodes]
            for node, code in zip(self.nodes, codes):
                if code not in (None, 0):
                    return node.failure()
            if all(code == 0 for code in codes):
                return None
            time.sleep(_POLL_S)
        return None

    def _stop_all(self) -> None:
        """Ask every node to stop (stdin EOF; a signal where stdin does not reach the node), then kill."""
        running = [node for node in self.nodes if node.proc.poll() is None]
        for node in running:
            node.close_stdin()
            if not node.spec.stdin_reaches_agent:
                node.signal_tree(signal.SIGTERM)
        self._wait_exit(running, self.stop_timeout)
        for signum in (signal.SIGTERM, signal.SIGKILL):
            running = [node for node in running if node.proc.poll() is None]
            if not running:
                break
            reason = "interrupted again" if self._force else f"still running after {self.stop_timeout:.0f}s"
            self._say(f"{len(running)} node(s) {reason}; sending {signal.Signals(signum).name}")
            for node in running:
                node.signal_tree(signum)
            self._wait_exit(running, _KILL_WAIT_S)
        for node in self.nodes:
            node.proc.wait()
            node.reader.join(timeout=_KILL_WAIT_S)

    def _wait_exit(self, nodes: list[_Node], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (time.monotonic() < deadline and not self._force
               and any(node.proc.poll() is None for node in nodes)):
            time.sleep(_POLL_S)
