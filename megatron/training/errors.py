"""The trainer's failures as an exit code and one line on stderr, so the first cause is not buried.

- Bad input (flags, configs, data, checkpoints, the SSD tier): ``<prog>: error: <message>``, exit code 2. When
  every rank hits the same error, only the first rank to report it prints (they agree through the job's store),
  and the others exit a moment later, so torchrun cannot stop it before its line is out.
- A collective that fails because another rank died or stopped answering:
  ``rank R: stopping: another rank failed (<exception type>)``, exit code 1, a moment after the failing rank
  (so torchrun and the launcher see that one first). Its own output holds the cause; a traceback here would only
  bury it.
- Anything else is a bug: its traceback is printed as usual.

``ptm-launch`` recognises these lines (ptm_launch/node_output.py): it shows the first cause once and exits with
its code.
"""
from __future__ import annotations

import datetime
import os
import re
import sys
import time
from typing import Callable, NoReturn, TypeVar

import torch.distributed as dist

from megatron.core.parallel_state import ParallelConfigError
from megatron.data.errors import DataError, OtherRankDataError
from megatron.training.arguments import ConfigError
from zero_cache import SSDTierError, ZeroConfigError
from zero_cache.checkpoint import CheckpointError

T = TypeVar("T")

EXIT_BAD_INPUT = 2
EXIT_OTHER_RANK_FAILED = 1
USER_ERRORS = (ConfigError, ParallelConfigError, CheckpointError, SSDTierError, ZeroConfigError, DataError)
# What gloo, NCCL and the c10d store say when the peer at the other end of a collective is gone or silent.
_PEER_LOST_RE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|socket timeout|timed out|timeout|"
    r"communicator was aborted|ncclRemoteError|remote process exited|peer .* (closed|gone)|failed to recv|"
    r"failed to send|read error|unexpected eof", re.IGNORECASE)
_REPORTED_KEY = "ptm_errors/first_reporter"
_STORE_TIMEOUT = datetime.timedelta(seconds=10)
# torchrun names the first rank it sees exit as the root cause, with a resolution of its 0.1 s poll (and
# timestamps of a second): a rank stopped by another one's failure leaves a little later, so that is the cause.
OTHER_RANK_EXIT_DELAY_S = 2.0


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


def one_line(exc: BaseException) -> str:
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__


def _first_to_report() -> bool:
    """True on exactly one rank of the job (the first to ask); rank 0 decides when there is no job store yet."""
    if not (dist.is_available() and dist.is_initialized()):
        return rank() == 0
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(_STORE_TIMEOUT)
        return store.add(_REPORTED_KEY, 1) == 1
    except Exception:  # the store went with the rank that hosted it: report rather than stay silent
        return True


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


def run_trainer(train: Callable[[], T], prog: str = "pretrain_gpt.py") -> T:
    """``train()``, with bad input turned into SystemExit(2) and another rank's failure into SystemExit(1)."""
    try:
        return train()
    except USER_ERRORS as exc:
        if _first_to_report():
            _print(f"{prog}: error: {one_line(exc)}")
        else:  # leave after the rank that prints: torchrun stops the others once the first rank has exited
            time.sleep(OTHER_RANK_EXIT_DELAY_S)
        _leave_process_group()
        raise SystemExit(EXIT_BAD_INPUT) from None
    except Exception as exc:
        if not is_other_rank_failure(exc):
            raise
        _print(f"rank {rank()}: stopping: another rank failed ({type(exc).__name__})")
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
