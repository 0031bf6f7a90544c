"""The trainer's failures as an exit code and one line on stderr, so the first cause is not buried.

- Bad input (flags, configs, data, checkpoints, the SSD tier): ``<prog>: error: <message>``, exit code 2. When
  every rank hits the same error, only the first rank to report it prints (they agree through the job's store;
  before it exists, as for bad flags, rank 0 prints), and the others exit a moment later, so torchrun cannot
  stop it before its line is out; stopped by torchrun meanwhile (SIGTERM), they too exit 2, silently.
- A collective that fails because another rank died or stopped answering:
  ``rank R: stopping: another rank failed (<exception type>[: <collective> at <file:line>[ timed out]])``, exit
  code 1, a moment after the failing rank (so torchrun and the launcher see that one first). Its own output
  holds the cause; a traceback here would only bury it. When no rank failed but one went silent (frozen, or its
  host lost power or its link), the collective times out and the line names the silent ranks, whose heartbeat
  stopped (heartbeat.py): ``rank R: stopping: rank S stopped answering (<type>: <collective> at <file:line>
  timed out; ...)``. That line is the cause the launcher reports.
- Anything else is a bug: its traceback is printed as usual.

``ptm-launch`` recognises these lines (ptm_launch/node_output.py): it shows the first cause once and exits with
its code.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, NoReturn, TypeVar

import torch.distributed as dist

from megatron.core.parallel_state import ParallelConfigError
from megatron.data.errors import DataError, OtherRankDataError
from megatron.training.arguments import ConfigError
from megatron.training.attention_backend import AttentionBackendError
from megatron.training.heartbeat import BEAT_S, silent_ranks
from megatron.training.lr_scheduler import SchedulerMismatchError
from megatron.training.run_log import LogFileError
from zero_cache import SSDTierError, ZeroConfigError
from zero_cache.checkpoint import CheckpointError

T = TypeVar("T")

EXIT_BAD_INPUT = 2
EXIT_OTHER_RANK_FAILED = 1
USER_ERRORS = (ConfigError, ParallelConfigError, CheckpointError, SSDTierError, ZeroConfigError, DataError,
               SchedulerMismatchError, AttentionBackendError, LogFileError)
# What gloo, NCCL and the c10d store say when the peer at the other end of a collective is gone or silent.
_PEER_LOST_RE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|socket timeout|timed out|timeout|"
    r"communicator was aborted|ncclRemoteError|remote process exited|peer .* (closed|gone)|failed to recv|"
    r"failed to send|read error|unexpected eof", re.IGNORECASE)
_TIMED_OUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)
_REPO = str(Path(__file__).resolve().parents[2]) + os.sep
_REPORTED_KEY = "ptm_errors/first_reporter"
_STORE_TIMEOUT = datetime.timedelta(seconds=10)
# torchrun names the first rank it sees exit as the root cause, with a resolution of its 0.1 s poll (and
# timestamps of a second): a rank stopped by another one's failure leaves a little later, so that is the cause.
OTHER_RANK_EXIT_DELAY_S = 2.0
PEERS_WAIT_S = 1.5  # below OTHER_RANK_EXIT_DELAY_S: the reporting rank still leaves first


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_other_rank_failure(exc: BaseException) -> bool:
    """A failure of this rank's communication caused by a peer that died or hung (not by this rank itself)."""
    if isinstance(exc, OtherRankDataError):
        return True
    if isinstance(exc, USER_ERRORS):
        return False
    if dist.is_available() and isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) and bool(_PEER_LOST_RE.search(str(exc)))


def waited_in(exc: BaseException) -> str:
    """``<collective> at <file:line>``: the innermost torch.distributed call in ``exc``'s traceback and the
    project's line that made it; an asynchronous collective fails in its handle's ``wait()``, called from the
    project (``wait at <file:line>``). ``""`` when the traceback shows neither."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_calls = [f.name for f in frames if f"torch{os.sep}distributed{os.sep}" in f.filename
                   and not f.name.startswith("_") and f.name != "wrapper"]
    ours = [f for f in frames if f.filename.startswith(_REPO) and f"{os.sep}site-packages{os.sep}" not in f.filename]
    site = f" at {ours[-1].filename[len(_REPO):]}:{ours[-1].lineno}" if ours else ""
    if torch_calls:
        return torch_calls[-1] + site
    return f"wait{site}" if ours and ".wait(" in (ours[-1].line or "") else ""


def one_line(exc: BaseException) -> str:
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__


def _job_store():
    """The job's key-value store: the process group's, or before it exists (bad flags) torchrun's agent store,
    which every rank of a torchrun job reaches; None elsewhere."""
    try:
        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
            store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=_STORE_TIMEOUT)
        else:
            return None
        store.set_timeout(_STORE_TIMEOUT)
        return store
    except Exception:  # the store went with the rank (or agent) that hosted it
        return None


def _first_to_report(store) -> bool:
    """True on exactly one rank of the job (the first to ask); rank 0 decides when there is no job store."""
    if store is None:
        return rank() == 0
    try:
        return store.add(_REPORTED_KEY, 1) == 1
    except Exception:  # the store went with the rank that hosted it: report rather than stay silent
        return True


def _wait_for_the_others(store) -> None:
    """Until every rank of the job has hit the error too (each counted in ``_first_to_report``), for at most
    ``PEERS_WAIT_S``: once this rank exits torchrun stops the others, and one stopped before it got here would
    leave by the signal instead of with exit code 2."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + PEERS_WAIT_S
    try:
        while store is not None and store.add(_REPORTED_KEY, 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:
        pass


def _print(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


@contextlib.contextmanager
def _terminated_exits_with(code: int):
    """Within: SIGTERM (torchrun stopping the job once the reporting rank has exited) leaves with ``code``."""
    def leave(signum, frame):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def whole_lines() -> None:
    """Make each printed line leave this process in one write. The ranks share the launcher's pipe, and with
    PYTHONUNBUFFERED (start.sh sets it) ``print`` writes a line's text and its newline separately, so another
    rank's line could land between the two."""
    for stream in (sys.stdout, sys.stderr):
        if type(stream) is io.TextIOWrapper:  # a terminal or pipe (not a test's capture)
            stream.reconfigure(line_buffering=True, write_through=False)


def run_trainer(train: Callable[[], T], prog: str = "pretrain_gpt.py") -> T:
    """``train()``, with bad input turned into SystemExit(2) and another rank's failure into SystemExit(1)."""
    whole_lines()
    try:
        return train()
    except USER_ERRORS as exc:
        # This process only leaves from here on, so a stop by torchrun is this exit too (before it is counted).
        with _terminated_exits_with(EXIT_BAD_INPUT):
            store = _job_store()
            if _first_to_report(store):
                _print(f"{prog}: error: {one_line(exc)}")
                _wait_for_the_others(store)
            else:  # leave after the rank that prints: torchrun stops the others once the first rank has exited
                time.sleep(OTHER_RANK_EXIT_DELAY_S)
            _leave_process_group()
        raise SystemExit(EXIT_BAD_INPUT) from None
    except Exception as exc:
        if not is_other_rank_failure(exc):
            raise
        where = waited_in(exc)
        timed_out = bool(_TIMED_OUT_RE.search(str(exc)))
        what = f"{type(exc).__name__}{': ' + where if where else ''}{' timed out' if where and timed_out else ''}"
        silent = [r for r in silent_ranks() if r != rank()] if timed_out else []
        if silent:
            who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
            _print(f"rank {rank()}: stopping: {who} stopped answering ({what}; no heartbeat from "
                   f"{'them' if len(silent) > 1 else 'it'} for {2.5 * BEAT_S:g} s)")
        else:
            _print(f"rank {rank()}: stopping: another rank failed ({what})")
        time.sleep(OTHER_RANK_EXIT_DELAY_S)
        raise SystemExit(EXIT_OTHER_RANK_FAILED) from None


def exit_with(main: Callable[[], object]) -> NoReturn:
    """Entry of the trainer script: run ``main`` and exit with its status.

    A failed run leaves without interpreter teardown: tearing down a process group whose peers are gone can
    abort (SIGABRT) or block, which would replace the real exit code and line with a misleading one. A run
    that succeeded destroys its process group first: left to the interpreter's teardown, gloo's threads can
    still hold work when Python is gone and abort the process ("terminate called without an active
    exception"), turning a finished run into a failed rank.
    """
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            _print(exc.code)
        if code:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _leave_process_group()
        raise
    except KeyboardInterrupt:
        sys.stdout.flush()
        os._exit(130)
    _leave_process_group()
    sys.exit(0)
