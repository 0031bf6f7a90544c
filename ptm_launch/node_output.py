"""One node's output as the launcher shows it, and the events it carries.

A node's stream mixes the ranks' output, torchrun's agent log and torchrun's own traceback. Shown: what the
ranks print, except the errors of ranks that only stopped because another rank failed (they would bury the
cause; they are counted instead). Kept out: the agent's log lines, which the launcher reads for events
(a worker failed, the agent restarts its workers, a rendezvous round completed with these ranks), and
torchrun's ``ChildFailedError`` traceback and summary box, which repeat the failure the launcher reports
itself. The formats read here are those of torch.distributed.elastic and of megatron/training/errors.py.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

# torch.distributed.elastic's log lines: "E1201 10:37:14.496000 16120 torch/.../api.py:1002] message"
_AGENT_LOG_RE = re.compile(r"^(?P<level>[IWEC])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ?(?P<msg>.*)$")
_WORKER_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_RESTART_RE = re.compile(r"Worker group \w+\. (\d+)/(\d+) attempts left; will restart worker group")
_MEMBERSHIP_RE = re.compile(r"Detected \d+ new nodes from group_rank=\d+; will restart worker group")
_RDZV_DONE_RE = re.compile(r"Rendezvous complete for workers")
_GLOBAL_RANKS_RE = re.compile(r"^\s*global_ranks=\[([\d, ]*)\]")
_RESTART_COUNT_RE = re.compile(r"^\s*restart_count=(\d+)")
# Agent warnings that only narrate what the launcher reports anyway.
_AGENT_NOISE_RE = re.compile(r"closing signal|death signal|Unable to shutdown process|failed \(exitcode")
_TORCHRUN_EXIT_RE = re.compile(r"^torch\.distributed\.elastic\.\S*(ChildFailedError|SignalException)\b")
_RANK_PREFIX_RE = re.compile(r"^(\[rank\d+\]:\s?)")
_TRACEBACK = "Traceback (most recent call last):"
_BOX_RULE_RE = re.compile(r"^=+$")
# megatron/training/errors.py: a rank that stops because another one failed, or names the ranks that went silent.
_SECONDARY_RE = re.compile(r"^rank \d+: stopping: another rank failed \(")
_SILENT_RE = re.compile(r"^rank \d+: stopping: ranks? [\d, ]+ stopped answering \(")
# A rank's exception when its peer is gone (what gloo, NCCL and the store say); such a rank is not the cause.
_PEER_LOST_RE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|socket timeout|communicator was aborted|ncclRemoteError|"
    r"remote process exited|DistNetworkError|DistStoreError|another rank failed", re.IGNORECASE)
# A line that states a cause: "prog: error: ..." (errors.py, argparse) or an exception line.
_CAUSE_RE = re.compile(r"^(?:[\w.\-/]+: error: |[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b: )")


@dataclass(frozen=True)
class WorkerFailed:
    local_rank: int
    exitcode: int  # torchrun's: negative for a signal
    time: float


@dataclass(frozen=True)
class RestartRequested:
    membership: bool  # True: new nodes joined (not counted by torchrun as a restart)
    time: float


@dataclass(frozen=True)
class RoundComplete:
    restart_count: int
    global_ranks: tuple[int, ...]
    time: float


@dataclass(frozen=True)
class CauseLine:
    text: str  # without a "[rankN]: " prefix
    rank: int | None  # from that prefix, when there is one
    time: float


@dataclass
class _Block:
    """A traceback being collected, shown or dropped once its exception line arrives."""
    lines: list[str] = field(default_factory=list)


class NodeOutput:
    """``feed`` one line at a time; it returns the lines to show now and records events in ``events``."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.secondary: list[tuple[float, str]] = []  # (time, line) of ranks stopped by another's failure
        self._blocks: dict[str, _Block] = {}
        self._in_box = 0  # rules of torchrun's summary box seen while dropping it
        self._drop_box = False
        self._restart_count = 0

    def feed(self, line: str, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        if self._drop_box:
            if _BOX_RULE_RE.match(line.strip()):
                self._in_box += 1
                self._drop_box = self._in_box < 2
            return []
        agent = _AGENT_LOG_RE.match(line)
        if agent:
            return self._agent_line(agent["level"], agent["msg"], line, now)
        prefix_match = _RANK_PREFIX_RE.match(line)
        prefix = prefix_match[1] if prefix_match else ""
        body = line[len(prefix):]
        if body.strip() == _TRACEBACK:
            shown = self._end_block(prefix, None, now)
            self._blocks[prefix] = _Block([line])
            return shown
        block = self._blocks.get(prefix)
        if block is not None:
            if body.startswith((" ", "\t")) or not body.strip():
                block.lines.append(line)
                return []
            return self._end_block(prefix, line, now)
        if _SECONDARY_RE.match(body):
            self.secondary.append((now, body))
            return []
        self._note_cause(body, prefix, now)
        return [line]

    def flush(self, now: float | None = None) -> list[str]:
        """At the end of the stream: show what is still held back."""
        now = time.monotonic() if now is None else now
        shown: list[str] = []
        for prefix in list(self._blocks):
            shown += self._end_block(prefix, None, now)
        return shown

    def _agent_line(self, level: str, msg: str, line: str, now: float) -> list[str]:
        failed = _WORKER_FAILED_RE.search(msg)
        if failed:
            self.events.append(WorkerFailed(int(failed[2]), int(failed[1]), now))
        elif _RESTART_RE.search(msg):
            self.events.append(RestartRequested(False, now))
        elif _MEMBERSHIP_RE.search(msg):
            self.events.append(RestartRequested(True, now))
        elif _RDZV_DONE_RE.search(msg):
            self._restart_count = 0
        elif (count := _RESTART_COUNT_RE.match(msg)) is not None:
            self._restart_count = int(count[1])
        elif (ranks := _GLOBAL_RANKS_RE.match(msg)) is not None:
            ids = tuple(int(r) for r in ranks[1].split(",") if r.strip())
            self.events.append(RoundComplete(self._restart_count, ids, now))
        if level == "I" or _AGENT_NOISE_RE.search(msg):
            return []
        return [line]

    def _end_block(self, prefix: str, exception_line: str | None, now: float) -> list[str]:
        """Close ``prefix``'s traceback with its exception line: drop torchrun's own and a lost peer's."""
        block = self._blocks.pop(prefix, None)
        if block is None:
            return [] if exception_line is None else self.feed(exception_line, now)
        if exception_line is None:
            return block.lines
        body = exception_line[len(prefix):]
        if not prefix and _TORCHRUN_EXIT_RE.match(body):
            self._drop_box, self._in_box = "ChildFailedError" in body, 0
            return []
        if _PEER_LOST_RE.search(body):
            self.secondary.append((now, f"{prefix}{body}".strip()))
            return []
        self._note_cause(body, prefix, now)
        return [*block.lines, exception_line]

    def _note_cause(self, body: str, prefix: str, now: float) -> None:
        if (_CAUSE_RE.match(body) and not _PEER_LOST_RE.search(body)) or _SILENT_RE.match(body):
            rank = int(re.sub(r"\D", "", prefix)) if prefix else None
            self.events.append(CauseLine(body.strip(), rank, now))
