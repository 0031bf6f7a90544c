"""Stand-in training job for the launcher tests: a tiny DDP regression model on gloo.

Rank 0 prints the all-reduce check, where every rank runs (address as its peers see it, local
rank, pid, chosen environment variable), and one mean loss per step, so tests can compare runs
across meshes. ``--fail-rank/--fail-step`` make one rank raise mid-run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def peer_address() -> str:
    """The local address used to reach MASTER_ADDR (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((os.environ["MASTER_ADDR"], 9))
        return sock.getsockname()[0]


def build_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x.sum(dim=1, keepdim=True)


def reference_losses(world: int, steps: int) -> list[float]:
    """One process doing what ``world`` DDP ranks do: the mean of the per-rank losses, averaged grads."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(world)))
        loss = loss / world
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
    parser.add_argument("--distributed-timeout-seconds", type=float, default=60.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--tag", default="", help="echoed back verbatim (argument quoting check)")
    parser.add_argument("--show-env", default="PTM_TEST_MARKER", help="variable every rank reports")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.distributed_timeout_seconds))
    rank, world = dist.get_rank(), dist.get_world_size()

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    where = [None] * world
    dist.all_gather_object(where, {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]),
                                   "address": peer_address(), "pid": os.getpid(),
                                   "env": os.environ.get(args.show_env)})
    if rank == 0:
        print(f"allreduce: {total.item():.1f} world: {world}", flush=True)
        print("ranks: " + json.dumps(where), flush=True)
        print("tag: " + json.dumps(args.tag), flush=True)

    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.8e}", flush=True)
        if rank == args.fail_rank and step == args.fail_step:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13's gloo teardown can abort at interpreter exit ("terminate called without an active
    # exception") after everything finished; this stand-in has nothing left to clean up, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
