"""Runs one process per node (ssh/pdsh/srun client or local agent), streams their output, and ends the job.

The job ends when every node exits 0, when it fails (the other nodes are stopped, the cause is reported once
and its exit code is the launcher's), or on Ctrl-C / SIGTERM: a preemption, passed to every node's agent, whose
ranks finish their step, save and exit within ``--preempt_timeout`` (exit 0 when all did). With restarts, a
node whose torchrun died (killed, or its host unreachable) is started again and rejoins the rendezvous; the
node hosting the rendezvous store takes every node with it, so then all are started again. With an elastic
range (``--nnodes MIN:MAX``), a node whose host became unreachable leaves the job instead, while MIN nodes
remain: the others' agents stop their ranks, and torchrun restarts them in a round without it. Its host is
tried again every ``rejoin_every`` seconds; once it answers, its torchrun joins and the job grows back (the
other nodes' torchrun restart their ranks for the larger round, which save first with --exit-signal-handler).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Callable, TextIO

import psutil

from ptm_launch.commands import NodeSpec
from ptm_launch.node_agent import PREEMPT_LINE, RESTART_LINE
from ptm_launch.node_output import CauseLine, NodeOutput, RestartRequested, RoundComplete, WorkerFailed
from ptm_launch.restarts import Failure, Restarts, cause_of

_POLL_S = 0.1
REJOIN_EVERY_S = 30.0
SAME_ROUND_S = 10.0  # the nodes' reports of one rendezvous round arrive within this of each other
_KILL_WAIT_S = 5.0
# A second signal this soon after the first is a copy of it (a wrapper passing it on as well), not a second try.
SAME_SIGNAL_S = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # what the agents pass on to the ranks
EXIT_BAD_INPUT = 2  # a rank's verdict on its input (megatron/training/errors.py, argparse): a restart repeats it


def relaunchable(code: int) -> bool:
    """The node's torchrun died (the agent reports 128 + signal) or ssh lost the host (255): torchrun could
    not decide anything, so starting it again is the launcher's job. Any other code is torchrun's verdict."""
    return code == 255 or code > 128


class _Node:
    def __init__(self, spec: NodeSpec, tail_lines: int, out: TextIO, out_lock: threading.Lock,
                 events: queue.Queue):
        self.spec = spec
        env = {**os.environ, **spec.env}
        # Own session: a terminal's Ctrl-C reaches only the launcher, which then stops nodes in order.
        self.proc = subprocess.Popen(spec.argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.output = NodeOutput()
        self.stopping = False  # the launcher asked it to stop: its exit code says nothing
        self.joining = False  # a host left behind, tried again: not part of the job until it joins a round
        self.global_ranks: tuple[int, ...] = ()
        self.round_time: float | None = None  # when its latest rendezvous round completed
        self.cause_lines: list[CauseLine] = []
        self._out, self._out_lock, self._events = out, out_lock, events
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _show(self, lines: list[str]) -> None:
        if not lines:
            return
        self.tail.extend(lines)
        with self._out_lock:
            try:
                for line in lines:
                    self._out.write(f"{self.spec.output_prefix}{line}\n")
                self._out.flush()
            except (OSError, ValueError):  # our own stdout is gone; keep draining so the node never blocks
                pass

    def _pump(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self._show(self.output.feed(line))
            self._forward_events()
        self._show(self.output.flush())
        self._forward_events()

    def _forward_events(self) -> None:
        while self.output.events:
            self._events.put((self, self.output.events.pop(0)))

    def close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def request_save(self) -> None:
        """Preemption: the agent passes it to torchrun's ranks. pdsh does not pass stdin on: ending its session
        tells the agent that the launcher went away, and it stops torchrun with --stop_timeout's grace."""
        if not self.spec.stdin_reaches_agent:
            self.signal_tree(signal.SIGTERM)
            return
        try:
            self.proc.stdin.write(PREEMPT_LINE)
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the node is already gone
            pass

    def request_restart(self) -> bool:
        """Another node left the job: the agent stops this node's ranks, so torchrun restarts them in a new round.
        False where stdin does not reach the agent (pdsh): the ranks then leave by --train-timeout-seconds."""
        if not self.spec.stdin_reaches_agent:
            return False
        try:
            self.proc.stdin.write(RESTART_LINE)
            self.proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

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

    def finish_reading(self) -> None:
        self.reader.join(timeout=_KILL_WAIT_S)

    def global_rank(self, local_rank: int) -> int | None:
        return self.global_ranks[local_rank] if local_rank < len(self.global_ranks) else None

    def describe_ranks(self) -> str:
        ranks = self.global_ranks
        return f", ranks {ranks[0]}-{ranks[-1]}" if ranks else ""


class Supervisor:
    """Ctrl-C/SIGTERM handlers call ``request_stop``; the work happens in ``run``'s polling loop.

    ``respawn(max_restarts)`` plans the nodes again (the torchrun of a node started again gets the restarts that
    are left); without it, or without restarts, a node's failure fails the job.
    """

    def __init__(self, specs: list[NodeSpec], stop_timeout: float, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, tail_lines: int = 20, restarts: Restarts | None = None,
                 respawn: Callable[[int], list[NodeSpec]] | None = None, preempt_timeout: float = 300.0,
                 min_nodes: int | None = None, rejoin_every: float = REJOIN_EVERY_S):
        self.specs, self.stop_timeout, self.out, self.err, self.tail_lines = specs, stop_timeout, out, err, tail_lines
        self.min_nodes = min_nodes  # --nnodes MIN:MAX: a lost node may leave while MIN remain; None: never
        self.rejoin_every = rejoin_every
        self._left: dict[int, float] = {}  # node rank of a node left behind -> when its host is tried again
        self.preempt_timeout = preempt_timeout
        self.restarts = restarts or Restarts(0)
        self.respawn = respawn
        self.nodes: list[_Node] = []
        self.failures: list[Failure] = []
        self._events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop_signal: int | None = None
        self._stop_time = 0.0
        self._force = False  # a second signal: kill at once
        self._bad_input: _Node | None = None  # a rank refused its input: the job ends instead of restarting

    def request_stop(self, signum: int) -> None:
        """Signal-handler safe: only sets flags."""
        now = time.monotonic()
        if self._stop_signal is None:
            self._stop_signal, self._stop_time = signum, now
        elif now - self._stop_time >= SAME_SIGNAL_S:
            self._force = True

    def _say(self, message: str) -> None:
        print(f"ptm-launch: {message}", file=self.err, flush=True)

    def _start(self, spec: NodeSpec) -> _Node:
        return _Node(spec, self.tail_lines, self.out, self._lock, self._events)

    def run(self) -> int:
        """Start every node and return the job's exit status."""
        for spec in self.specs:
            try:
                self.nodes.append(self._start(spec))
            except OSError as exc:
                self._say(f"cannot start node {spec.node_rank} ({spec.host}): {exc}")
                self._stop_all()
                return 1
        failed = self._wait()
        if self._stop_signal is not None and failed is None:
            return self._preempt()
        if failed is None:
            for node in self.nodes:
                node.finish_reading()
            self._handle_events()
            return 0
        if len(self.nodes) > 1:
            self._say(f"node {failed.spec.node_rank} ({failed.spec.host}) failed; stopping the other node(s)")
        self._stop_all()
        return self._report(failed)

    # ---- the polling loop -------------------------------------------------------------------------------
    def _wait(self) -> _Node | None:
        """Until every node exits 0 (None), one fails for good (that node), or a stop is requested (None)."""
        while self._stop_signal is None:
            self._handle_events()
            if self._bad_input is not None:
                return self._bad_input
            for line in self.restarts.messages(time.monotonic()):
                self._say(line)
            self._try_left_behind(time.monotonic())
            done = True
            for node in list(self.nodes):
                code = node.proc.poll()
                if code is None:
                    done = False
                elif node.joining:  # its host still does not answer (or it failed before it joined): later
                    node.finish_reading()
                    self.nodes.remove(node)
                    self._left[node.spec.node_rank] = time.monotonic() + self.rejoin_every
                elif code != 0 and not node.stopping:
                    node.finish_reading()
                    self._handle_events()
                    if not (self._leave_behind(node, code) or self._relaunch(node, code)):
                        return node
                    done = False
                    break
            if done:
                return None
            if all(n.joining or n.proc.poll() == 0 for n in self.nodes):  # the job ended before they joined
                joining = [n for n in self.nodes if n.joining]
                self._stop_nodes(joining)
                for n in joining:
                    n.finish_reading()
                    self.nodes.remove(n)
                return None
            time.sleep(_POLL_S)
        return None

    def _handle_events(self) -> None:
        while True:
            try:
                node, event = self._events.get_nowait()
            except queue.Empty:
                return
            if node not in self.nodes:
                continue  # a node started again since
            if isinstance(event, CauseLine):
                node.cause_lines.append(event)
                for failure in self._round_failures():  # reported before its line arrived
                    if failure.node_rank == node.spec.node_rank:
                        stated = self._stated(node, failure)
                        if stated is not failure:
                            self._replace(failure, stated)
                self._add_unreported(node)
            elif isinstance(event, WorkerFailed):
                failure = self._stated(node, Failure(node.spec.node_rank, node.spec.host, event.time, event.exitcode,
                                                     event.local_rank, node.global_rank(event.local_rank)))
                from_line = next((f for f in self._round_failures()
                                  if f.unreported and f.global_rank == failure.global_rank), None)
                if from_line is not None:  # its exit came after all: the report takes the place of its line
                    self._replace(from_line, failure)
                else:
                    self.failures.append(failure)
                    self.restarts.add(failure)
                self._add_unreported(node)
                if event.exitcode == EXIT_BAD_INPUT and self.restarts.budget and self._bad_input is None:
                    self._bad_input = node
                    self.restarts.cancel()
            elif isinstance(event, RestartRequested):
                if self._bad_input is not None:
                    continue
                if self.restarts.begin(event.time):
                    for failure in self._round_failures():
                        if failure not in self.restarts.pending.failures:
                            self.restarts.add(failure)
            elif isinstance(event, RoundComplete):
                node.global_ranks, node.round_time = event.global_ranks, event.time
                if node.joining:
                    node.joining = False
                    self._say(f"node {node.spec.node_rank} ({node.spec.host}) is back: the job grows to "
                              f"{len(self.nodes)} node(s)")
                for line in self.restarts.rejoined(node.spec.node_rank, len(self.nodes), event.time):
                    self._say(line)

    def _stated(self, node: _Node, failure: Failure) -> Failure:
        """``failure`` with the error line its node printed in this round, if one has arrived: its rank's own
        line, else one without a rank prefix, else (its global rank unknown, and not aborted: an aborted rank
        may be a peer of the cause, ended by its collectives' threads) any. The failure itself if none."""
        if failure.cause_line is not None or not failure.may_state_cause():
            return failure
        lines = [c for c in node.cause_lines if c.time >= self.restarts.round_start]
        own = [c for c in lines if c.rank is not None and c.rank == failure.global_rank]
        unprefixed = [c for c in lines if c.rank is None]
        anyone = lines if failure.global_rank is None and failure.exitcode >= 0 else []
        chosen = own or unprefixed or anyone
        return dataclasses.replace(failure, cause_line=chosen[0].text) if chosen else failure

    def _add_unreported(self, node: _Node) -> None:
        """Once a rank of ``node`` has failed in this round, a rank of it that printed its error line but whose
        exit torchrun did not report (torchrun reports the first exits it sees and stops the other ranks, and a
        peer aborted by its collectives' threads can be first) is a failure too: its line makes it the cause."""
        mine = [f for f in self._round_failures() if f.node_rank == node.spec.node_rank]
        if not mine:
            return
        known = {f.global_rank for f in mine}
        for line in node.cause_lines:
            if line.time < self.restarts.round_start or line.rank in known or line.rank not in node.global_ranks:
                continue
            known.add(line.rank)
            failure = Failure(node.spec.node_rank, node.spec.host, line.time, 1, node.global_ranks.index(line.rank),
                              line.rank, line.text, unreported=True)
            self.failures.append(failure)
            self.restarts.add(failure)

    def _replace(self, old: Failure, new: Failure) -> None:
        self.failures[self.failures.index(old)] = new
        self.restarts.replace(old, new)

    def _round_failures(self) -> list[Failure]:
        return [f for f in self.failures if f.time >= self.restarts.round_start]

    # ---- going on without a node ---------------------------------------------------------------------------
    def _leave_behind(self, node: _Node, code: int) -> bool:
        """An unreachable host (ssh 255) leaves an elastic job while enough nodes remain; not the node hosting the
        rendezvous store (the others cannot meet without it). The restart it causes is counted when the other
        nodes' torchrun report it, as any other."""
        members = sum(not n.joining for n in self.nodes)  # a host tried again is not one until it joins
        if self.min_nodes is None or code != 255 or node.spec.node_rank == 0 or members - 1 < self.min_nodes:
            return False
        now = time.monotonic()
        failure = Failure(node.spec.node_rank, node.spec.host, now, code)
        self.failures.append(failure)
        self.restarts.add(failure)
        self.nodes.remove(node)
        self._left[node.spec.node_rank] = now + self.rejoin_every
        self._say(f"{failure.describe()}; going on without it on {len(self.nodes)} node(s) (at least "
                  f"{self.min_nodes} by --nnodes, the same global batch): their ranks restart; its host is tried "
                  f"again every {self.rejoin_every:.0f} s")
        pending = self.restarts.pending
        if pending is not None:
            # torchrun restarts the ranks already (its rendezvous found the node gone, or a rank failed): the
            # restart is over once the nodes that remain have joined.
            if pending.rejoined >= {n.spec.node_rank for n in self.nodes}:
                for line in self.restarts.rejoined(self.nodes[0].spec.node_rank, len(self.nodes), now):
                    self._say(line)
            return True
        if self._round_without(node):
            return True  # torchrun's rendezvous already formed a round without it
        unreached = [other for other in self.nodes if not other.request_restart()]
        if unreached:
            self._say(f"{len(unreached)} node(s) cannot be told (pdsh): their ranks leave once their collectives "
                      f"time out (pretrain_gpt.py --train-timeout-seconds)")
        return True

    def _round_without(self, lost: _Node) -> bool:
        """Every node that remains joined a round after the last one ``lost`` was in. The nodes of one round
        report it within moments of each other; a new round takes a restart of the ranks (SAME_ROUND_S)."""
        return lost.round_time is not None and all(
            n.round_time is not None and n.round_time > lost.round_time + SAME_ROUND_S for n in self.nodes)

    def _try_left_behind(self, now: float) -> None:
        """Start the node of a host left behind again when its time has come (not while a restart is under way):
        if the host answers, its torchrun joins the rendezvous and the job grows; if not, ssh fails within its
        ConnectTimeout and the host is tried again later."""
        for node_rank, when in list(self._left.items()):
            if now < when or self.restarts.pending is not None or self.respawn is None:
                continue
            del self._left[node_rank]
            try:
                spec = next(s for s in self.respawn(self.restarts.left) if s.node_rank == node_rank)
                node = self._start(spec)
            except (OSError, ValueError, StopIteration):
                self._left[node_rank] = now + self.rejoin_every
                continue
            node.joining = True
            self.nodes.append(node)

    # ---- starting a node again ----------------------------------------------------------------------------
    def _relaunch(self, node: _Node, code: int) -> bool:
        """Start a node whose torchrun died again (every node when it hosted the rendezvous store)."""
        if not relaunchable(code):
            return False
        now = time.monotonic()
        failure = Failure(node.spec.node_rank, node.spec.host, now, code)
        self.failures.append(failure)
        if self.respawn is None or not self.restarts.begin_node(node.spec.node_rank, now):
            return False
        self.restarts.add(failure)
        try:
            specs = {spec.node_rank: spec for spec in self.respawn(self.restarts.left)}
        except (OSError, ValueError) as exc:  # e.g. the hostfile is gone or was edited into an error
            self._say(f"{failure.describe()}; cannot plan its start again: {exc}")
            return False
        store_host = node.spec.node_rank == 0
        if store_host and len(self.nodes) > 1:
            self._say(f"{failure.describe()}; it hosted the rendezvous, so every node starts again")
            others = [n for n in self.nodes if n is not node]
            self._stop_nodes(others)
            again = self.nodes
        else:
            self._say(f"{failure.describe()}; starting its torchrun again")
            again = [node]
        for old in again:
            old.finish_reading()
            try:
                self.nodes[self.nodes.index(old)] = self._start(specs[old.spec.node_rank])
            except OSError as exc:
                self._say(f"cannot start node {old.spec.node_rank} ({old.spec.host}) again: {exc}")
                return False
        return True

    # ---- the end of a failed job ---------------------------------------------------------------------------
    def _report(self, failed: _Node) -> int:
        """Name the cause once (its own line was shown as it happened) and return its exit status."""
        self._handle_events()
        cause = cause_of(self._round_failures())
        if cause is None:  # torchrun failed before any rank did (e.g. the rendezvous)
            cause = Failure(failed.spec.node_rank, failed.spec.host, time.monotonic(), failed.proc.returncode)
        secondary = sum(1 for n in self.nodes for t, _ in n.output.secondary if t >= self.restarts.round_start)
        node = next((n for n in self.nodes if n.spec.node_rank == cause.node_rank), None)
        details = []
        if cause.cause_line is None and node is not None and node.tail:
            self._say(f"last {len(node.tail)} output lines of node {cause.node_rank} ({cause.host}):")
            for line in node.tail:
                print(f"    {line}", file=self.err)
        elif cause.cause_line is not None:
            details.append("its error is above")
        if secondary:
            details.append(f"{secondary} other rank(s) stopped because of it")
        if self._bad_input is not None:
            details.append(f"exit code {EXIT_BAD_INPUT} is bad input: not restarted, it would fail the same way")
        elif self.restarts.budget:
            details.append(f"{self.restarts.used} of {self.restarts.budget} restart(s) used")
        self._say(f"job failed: {cause.describe()}" + (f" ({'; '.join(details)})" if details else ""))
        return cause.exit_status()

    # ---- preemption ----------------------------------------------------------------------------------------
    def _preempt(self) -> int:
        """Ctrl-C / SIGTERM: every rank finishes its step, saves and exits; 0 when every node exited 0. The nodes
        get --preempt_timeout seconds (a second signal cuts it short), then they are stopped without a save."""
        name = signal.Signals(self._stop_signal).name
        running = [node for node in self.nodes if node.proc.poll() is None]
        self._say(f"{name} received: asking every rank to finish its step, save a checkpoint and exit (up to "
                  f"{self.preempt_timeout:.0f}s, --preempt_timeout; a second signal stops them at once)")
        for node in running:
            node.request_save()
        deadline = time.monotonic() + self.preempt_timeout
        while not self._force and time.monotonic() < deadline and any(n.proc.poll() is None for n in running):
            self._handle_events()
            time.sleep(_POLL_S)
        left = [node for node in running if node.proc.poll() is None]
        if left:
            reason = "interrupted again" if self._force else f"still running after {self.preempt_timeout:.0f}s"
            self._say(f"{len(left)} node(s) {reason}; stopping them without a save")
            self._stop_nodes(left)
        for node in self.nodes:
            node.finish_reading()
        self._handle_events()
        if all(node.proc.returncode == 0 for node in self.nodes):
            self._say(f"stopped after {name}: every rank finished its step and exited 0 (pretrain_gpt.py "
                      f"--exit-signal-handler saves before it exits)")
            return 0
        cause = cause_of(self._round_failures())
        if left or cause is None or (cause.exitcode < 0 and -cause.exitcode in STOP_SIGNALS):
            exits = ", ".join(f"node {n.spec.node_rank} ({n.spec.host}) {n.proc.returncode}" for n in self.nodes)
            self._say(f"stopped by {name} without a clean exit of every rank (exit codes: {exits}; no checkpoint of "
                      f"this step: pretrain_gpt.py saves on a signal only with --exit-signal-handler)")
            return 128 + self._stop_signal
        stated = " (its error is above)" if cause.cause_line else ""
        self._say(f"stopped after {name}, but {cause.describe()}{stated}")
        return cause.exit_status()

    # ---- stopping -------------------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        self._stop_nodes(self.nodes)
        for node in self.nodes:
            node.proc.wait()
            node.finish_reading()

    def _stop_nodes(self, nodes: list[_Node]) -> None:
        """Ask nodes to stop (stdin EOF; a signal where stdin does not reach the node), then kill."""
        running = [node for node in nodes if node.proc.poll() is None]
        for node in nodes:
            node.stopping = True
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
        for node in nodes:
            node.proc.wait()

    def _wait_exit(self, nodes: list[_Node], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (time.monotonic() < deadline and not self._force
               and any(node.proc.poll() is None for node in nodes)):
            time.sleep(_POLL_S)
