"""Run a function in N processes with torch.distributed (gloo) set up.

Used by every multi-process test: each rank runs ``fn(rank, world_size, *args)``
and the parent gets back the list of return values ordered by rank. A rank that
raises fails the whole call with that rank's traceback; a rank that hangs fails
it after ``timeout`` seconds (the others are killed, nothing is left running).

Ranks are forked from a ``forkserver`` that imported torch and the project once: a fresh interpreter per
rank would spend seconds of CPU importing them on every call. The server forks before any tensor work, so
ranks start clean; each rank takes the caller's environment and working directory and runs its exit handlers,
as a spawned one would.
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import queue
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torchrun, of the interpreter running the tests: a venv made over a GPU machine's own torch
# (--system-site-packages) has no bin/torchrun of its own.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "zero_cache", "megatron.training.training"]


def _worker(rank, world_size, port, backend, timeout, env, cwd, fn, args, kwargs, results):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor data into the message; torch's queue would share memory
        # that disappears when this process exits before the parent reads it.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from argparse
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit._run_exitfuncs()  # a forked process ends without them; the code under test relies on them


class _PortTaken(Exception):
    """Rank 0's store found its port taken between ``free_port`` and the bind (another test took it)."""


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, backend: str = "gloo", **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank. A port
    taken by another test before the ranks bound it is tried again on a new one (nothing of ``fn`` ran yet)."""
    for _ in range(3):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout, backend)
        except _PortTaken:
            pass
    raise RuntimeError("the rendezvous port was taken three times in a row by other processes")


def _run_once(fn, world_size: int, args, kwargs, timeout: float, backend: str) -> list:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout, dict(os.environ), os.getcwd(),
                                                            fn, args, kwargs, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, object] = {}
    try:
        deadline = timeout + 60.0  # collectives time out first; this is the backstop
        while len(outs) < world_size:
            try:
                rank, status, payload = results.get(timeout=deadline)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(outs))} did not finish "
                                   f"within {deadline:.0f}s") from None
            if status == "error":
                if "EADDRINUSE" in payload and "init_process_group" in payload:
                    raise _PortTaken
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            outs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [outs[r] for r in range(world_size)]
