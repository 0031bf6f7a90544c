"""Failures of ranks and nodes, which one is the cause, and the job's restart budget with its log lines.

torchrun's agents restart the workers (``--max-restarts``, c10d rendezvous); the launcher only starts a node's
torchrun again when that torchrun itself died. Either way one failure is one restart of the job, whichever
nodes report it: a restart is *pending* from the first report until every node has joined the next
rendezvous round, and everything reported meanwhile belongs to it.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass, field

from ptm_launch.checkpoints import CheckpointTracker

ANNOUNCE_AFTER_S = 1.5  # wait for the other nodes' reports before naming the cause
# torchrun tails its ranks' output from files, so a rank's error line can reach us after torchrun's report of
# its exit: a cause that exited without a stated error is given this long for its line before it is announced.
CAUSE_LINE_WAIT_S = 10.0


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class Failure:
    """A rank (``local_rank`` set) or a node's torchrun / connection (``local_rank`` None) that failed."""
    node_rank: int
    host: str
    time: float
    exitcode: int  # a rank's: torchrun's (negative: signal); a node's: its process's exit status
    local_rank: int | None = None
    global_rank: int | None = None
    cause_line: str | None = None  # what that node printed as the error (a rank's failure only)
    # The rank printed its error but torchrun reported another rank's exit and stopped this one: known only
    # from its line (its exit code is not known; counted as 1).
    unreported: bool = False

    @property
    def is_node(self) -> bool:
        return self.local_rank is None

    def priority(self) -> int:
        """How likely this is the cause rather than a consequence: a dead node, a rank killed by a signal or
        with a stated error beat ranks that exited 1 or were stopped (SIGTERM) by torchrun. SIGABRT ranks
        below a stated error: it is how the collectives' own threads end a rank whose peer vanished (gloo's
        ``terminate called without an active exception``, NCCL's watchdog)."""
        if self.is_node:
            return 6
        if self.exitcode < 0:
            if -self.exitcode in (signal.SIGTERM, signal.SIGINT):
                return 0
            if -self.exitcode == signal.SIGABRT:  # stated error first, then an abort in the teardown: as exit 1
                return 3 if self.cause_line else 2
            return 5
        if self.exitcode not in (0, 1):
            return 4
        return 3 if self.cause_line else 1

    def may_state_cause(self) -> bool:
        """A rank that can have printed its error: it exited, or aborted (possibly after an exception);
        a rank killed by any other signal printed nothing about it."""
        return not self.is_node and (self.exitcode >= 0 or -self.exitcode == signal.SIGABRT)

    def exit_status(self) -> int:
        return 128 - self.exitcode if self.exitcode < 0 else (self.exitcode if self.exitcode < 256 else 1)

    def describe(self) -> str:
        if self.is_node:
            return f"node {self.node_rank} ({self.host}) {node_exit(self.exitcode)}"
        rank = f"rank {self.global_rank}" if self.global_rank is not None else f"local rank {self.local_rank}"
        where = f"{self.host}, local rank {self.local_rank}" if self.global_rank is not None else self.host
        if self.unreported:
            return f"{rank} ({where}) failed (torchrun stopped it before its exit)"
        if self.exitcode < 0:
            return f"{rank} ({where}) was killed by {signal_name(-self.exitcode)}"
        return f"{rank} ({where}) exited with code {self.exitcode}"


def node_exit(code: int) -> str:
    if code == 255:
        return "lost its connection (ssh exit code 255: the host died, rebooted or became unreachable)"
    if code > 128:
        return f"lost its torchrun (killed by {signal_name(code - 128)}, exit code {code})"
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"failed: exit code {code}"


def cause_of(failures: list[Failure]) -> Failure | None:
    """The failure most likely to be the cause: highest priority, then the earliest."""
    return max(failures, key=lambda f: (f.priority(), -f.time), default=None)


@dataclass
class _Pending:
    number: int
    opened: float
    failures: list[Failure] = field(default_factory=list)
    rejoined: set[int] = field(default_factory=set)
    started_again: set[int] = field(default_factory=set)  # nodes whose torchrun the launcher started again
    announced: bool = False


class Restarts:
    """The job's restart budget and the log line of each restart (``messages`` returns them when due)."""

    def __init__(self, budget: int, checkpoints: CheckpointTracker | None = None):
        self.budget = budget
        self.used = 0
        self.checkpoints = checkpoints or CheckpointTracker(None)
        self.pending: _Pending | None = None
        self.round_start = 0.0  # failures before this belong to earlier (finished) restarts

    @property
    def left(self) -> int:
        return max(0, self.budget - self.used)

    def begin(self, now: float) -> bool:
        """A restart starts (or one is already pending); False when the budget is spent."""
        if self.pending is not None:
            return True
        if self.left == 0:
            return False
        self.used += 1
        self.pending = _Pending(self.used, now)
        return True

    def begin_node(self, node_rank: int, now: float) -> bool:
        """The launcher starts a node's torchrun again; a node that fails again before the job is back (its host
        is gone, say) costs another restart, so this ends when the budget does."""
        pending = self.pending
        if pending is not None and node_rank in pending.started_again:
            if self.left == 0:
                return False
            self.used += 1
            pending.number = self.used
        elif not self.begin(now):
            return False
        self.pending.started_again.add(node_rank)
        return True

    def cancel(self) -> None:
        """The pending restart does not happen (the job ends instead): it is not counted."""
        if self.pending is not None:
            self.used -= 1
            self.pending = None

    def add(self, failure: Failure) -> None:
        if self.pending is not None:
            self.pending.failures.append(failure)

    def replace(self, old: Failure, new: Failure) -> None:
        """``old`` is now known better (its error line arrived late)."""
        if self.pending is not None and old in self.pending.failures:
            failures = self.pending.failures
            failures[failures.index(old)] = new

    def rejoined(self, node_rank: int, nnodes: int, now: float) -> list[str]:
        """A node joined a new rendezvous round; once all have, the restart is done."""
        pending = self.pending
        if pending is None:
            return []
        pending.rejoined.add(node_rank)
        if len(pending.rejoined) < nnodes:
            return []
        out = self.messages(now, force=True)
        out.append(f"restart {pending.number}: all {nnodes} node(s) rejoined {now - pending.opened:.1f} s after "
                   f"the failure; training resumes")
        self.pending = None
        self.round_start = now
        return out

    def messages(self, now: float, force: bool = False) -> list[str]:
        """The line announcing the pending restart, once its cause has had time to arrive."""
        pending = self.pending
        if pending is None or pending.announced:
            return []
        cause = cause_of(pending.failures)
        if not force:
            waited = now - pending.opened
            unstated = cause is not None and cause.may_state_cause() and not cause.cause_line
            if waited < ANNOUNCE_AFTER_S or (unstated and waited < CAUSE_LINE_WAIT_S):
                return []
        pending.announced = True
        what = cause.describe() if cause else "a rank failed"
        if cause is not None and cause.cause_line and not cause.is_node:
            what += f": {cause.cause_line}"
        return [f"restart {pending.number} of {self.budget}: {what}; restarting all ranks "
                f"{self.checkpoints.resume_point()}; {self.left} restart(s) left"]
