"""--train-timeout-seconds: once training runs, a collective whose peer went silent fails within that time (not
--distributed-timeout-minutes), and the rank's one line names the collective and where it was called;
checkpoints get the long timeout back."""
from __future__ import annotations

import contextlib
import datetime
import io
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.training import errors
from megatron.training.collective_timeout import CollectiveTimeout
from megatron.training.heartbeat import Heartbeat, silent_ranks
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess

SILENT_S = 5.0  # how long rank 1 answers nothing (a host that lost its link)


def _silent_peer(rank, world_size, phase):
    timeouts = CollectiveTimeout(datetime.timedelta(seconds=120), datetime.timedelta(seconds=1))
    timeouts.training()  # the first step has run
    if rank == 1:
        time.sleep(SILENT_S)
        if phase == "training":
            return None
    start = time.monotonic()
    if phase == "training":
        err = io.StringIO()
        errors.OTHER_RANK_EXIT_DELAY_S = 0.0
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stopped:
            errors.run_trainer(lambda: dist.all_reduce(torch.ones(1)))
        return time.monotonic() - start, stopped.value.code, err.getvalue()
    with timeouts.long():  # a checkpoint: the peer is slow, not gone
        dist.all_reduce(torch.ones(1))
    return time.monotonic() - start


def test_a_silent_peer_ends_the_round_within_the_training_timeout_and_is_named():
    elapsed, code, line = run_distributed(_silent_peer, 2, "training", timeout=120)[0]
    assert code == errors.EXIT_OTHER_RANK_FAILED and elapsed < SILENT_S - 2, (elapsed, line)
    call = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "run_trainer(lambda" in text)
    assert line == f"rank 0: stopping: another rank failed (RuntimeError: all_reduce at " \
                   f"tests/training/test_collective_timeout.py:{call} timed out)\n"


def test_a_checkpoint_waits_with_the_long_timeout():
    assert run_distributed(_silent_peer, 2, "long", timeout=120)[0] >= SILENT_S - 1


def _heartbeats(rank, world_size):
    beat = Heartbeat(every_s=0.2)
    dist.barrier()
    if rank == 2:
        beat.close()  # as a frozen process: its thread no longer beats
    dist.barrier()
    silent = silent_ranks(every_s=0.2) if rank == 0 else None
    dist.barrier()
    beat.close()
    return silent


def test_the_ranks_whose_heartbeat_stopped_are_the_silent_ones():
    assert run_distributed(_heartbeats, 3)[0] == [2]
