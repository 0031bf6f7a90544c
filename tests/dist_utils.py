"""Run a function in N processes with torch.distributed (gloo) set up.

Used by every multi-process test: each rank runs ``fn(rank, world_size, *args)``
and the parent gets back the list of return values ordered by rank. A rank that
raises fails the whole call with that rank's traceback; a rank that hangs fails
it after ``timeout`` seconds (the others are killed, nothing is left running).

Ranks are forked from a ``forkserver`` that imported torch and the project once: a fresh interpreter per
rank would spend seconds of CPU importing them on every call. The server forks before any tensor work, so
ranks start clean; each rank takes the caller's environment and working directory and runs its exit handlers,
as a spawned one would.

The rendezvous store is served by the calling process on a port the kernel gives it and keeps until the call
ends: a port picked free and bound later by rank 0 could be taken in between by another test running beside
this one, whose ranks would then meet ours in one store.
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import queue
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torchrun, of the interpreter running the tests: a venv made over a GPU machine's own torch
# (--system-site-packages) has no bin/torchrun of its own.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "zero_cache", "megatron.training.training"]


def _worker(rank, world_size, port, backend, timeout, env, cwd, fn, args, kwargs, results):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        wait = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=wait)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=wait)
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


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, backend: str = "gloo", **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    procs = [ctx.Process(target=_worker, args=(r, world_size, store.port, backend, timeout, dict(os.environ),
                                               os.getcwd(), fn, args, kwargs, results),
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
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            outs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return [outs[r] for r in range(world_size)]
