"""The training step's hot path on the emulated accelerator, as a GPU would see it.

- No host synchronisation on the training thread, which on a GPU is the thread that queues the kernels: no
  scalar read of a tensor (``.item()``, ``float()``, ``bool()``), no copy between pinned host memory and the
  device issued by it (copies belong on the copy streams), and no wait of its own for a copy still running.
  Counted per step with pinned host states, on host memory and on SSD, fp32 and bf16; the same audit of a
  configuration with pageable host shards shows the staging copies and waits it would catch. The step's one
  deliberate read, the global gradient norm (``tolist`` of two numbers), is checked on a GPU in tests/cuda.
- Every rank asks for the same collectives in the same order, whatever the timing: copies with random delays
  of their own on each rank, random pauses of the training thread and of the host's update change when
  gathers are prefetched and when the update under the next forward reaches each chunk, never the sequence
  (on a GPU the training thread issues every collective, in the order it asks; NCCL needs that order to be
  the same on every rank).
"""
from __future__ import annotations

import random
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_utils import run_distributed
from tests.zero_cache.common import batches, ds_config, make_engine, rank_micro_batches
from zero_cache.comm import observe_collectives
from zero_cache.optimizer import ShardedAdam

pytestmark = pytest.mark.multiprocess

DP, STEPS, WARM_UP = 2, 4, 2
EMULATOR = {"enabled": True, "h2d_gbps": 0.2, "d2h_gbps": 0.2, "random_delay_ms": 2.0}


class HostSyncAudit(TorchDispatchMode):
    """Ops the training thread runs that would synchronise a GPU with its host: scalar reads, and copies with
    pinned host memory on exactly one side (the emulator's device memory is every tensor that is not
    registered as pinned host memory)."""

    def __init__(self, streams):
        super().__init__()
        self.streams = streams
        self.scalar_reads = 0
        self.host_device_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.scalar_reads += 1
        elif name in ("copy_", "_to_copy"):
            host = [self.streams.pinned(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if any(host) and not all(host):
                self.host_device_copies += 1
        return func(*args, **kwargs)


def _config(world_size, where: str, nvme: str, pinned: bool, bf16: bool = False, emulator=EMULATOR, **zero):
    place = {"device": where, "pin_memory": pinned, **({"nvme_path": nvme} if where == "nvme" else {})}
    cfg = ds_config(3, world_size, sub_group_size=600, offload_optimizer=dict(place), offload_param=dict(place),
                    emulated_accelerator=emulator, **zero)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _audit(rank, world_size, config):
    engine = make_engine(config)
    data = batches(STEPS)
    rows = []
    for s in range(STEPS):
        compute, step = HostSyncAudit(engine.streams), HostSyncAudit(engine.streams)
        for mb in rank_micro_batches(data[s], rank, world_size):
            with compute:
                loss = engine(mb)
                engine.backward(loss)
        with step:
            engine.step()
        waits = engine.copy_stats().host_waits
        rows.append({"forward_backward": (compute.scalar_reads, compute.host_device_copies),
                     "step": (step.scalar_reads, step.host_device_copies), "host_waits": waits})
    engine.close()
    return rows[WARM_UP:]


CASES = {"host-fp32": ("cpu", True, False), "ssd-fp32": ("nvme", True, False), "host-bf16": ("cpu", True, True),
         "ssd-bf16": ("nvme", True, True)}


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_synchronisation_in_the_steady_step(case, tmp_path):
    where, pinned, bf16 = CASES[case]
    config = _config(DP, where, str(tmp_path), pinned, bf16)
    for rows in run_distributed(_audit, DP, config, timeout=240):
        for row in rows:
            assert row == {"forward_backward": (0, 0), "step": (0, 0), "host_waits": 0}, row


def test_the_audit_sees_the_staging_of_pageable_shards(tmp_path):
    """Pageable host shards must be copied into pinned buffers by the thread that issues the copy, and wait for
    a buffer when both are in flight: what the pinned configurations above are shown not to do. The copies are
    slowed (a shard takes milliseconds) so that the prefetch has both buffers in flight whatever else loads this
    machine; at the shared emulator's speed a busy machine's slower compute let them finish in time."""
    slow = {**EMULATOR, "h2d_gbps": 0.002, "d2h_gbps": 0.002, "random_delay_ms": 0.0}
    for rows in run_distributed(_audit, DP, _config(DP, "cpu", "", pinned=False, emulator=slow), timeout=240):
        for row in rows:
            assert row["forward_backward"][0] == 0 and row["forward_backward"][1] > 0, row
        assert sum(row["host_waits"] for row in rows) > 0, rows


def _sequence(rank, world_size, config, seed):
    """Every collective this rank asked for over STEPS steps, in the order the training thread asked (the order
    a GPU issues them in), with random pauses of its own."""
    requests = []
    rng = random.Random(seed * 100 + rank)
    update = ShardedAdam.update_chunks

    def slow_update(self, *args, **kwargs):  # the update under the next forward reaches chunks at other times
        time.sleep(rng.uniform(0, 0.004))
        return update(self, *args, **kwargs)
    ShardedAdam.update_chunks = slow_update
    engine = make_engine(config)
    for m in engine.module.modules():
        m.register_forward_pre_hook(lambda *_: time.sleep(rng.uniform(0, 0.003)))
    data = batches(STEPS)
    with observe_collectives(lambda kind, tensor, group, tag: requests.append((kind, tag, tensor.numel()))):
        for s in range(STEPS):
            for mb in rank_micro_batches(data[s], rank, world_size):
                loss = engine(mb)
                time.sleep(rng.uniform(0, 0.005))
                engine.backward(loss)
            engine.step()
    engine.close()
    return requests


@pytest.mark.parametrize("where,extra", [("cpu", {}), ("nvme", {}), ("cpu", {"speculative_update": True}),
                                         ("nvme", {"overlap_optimizer_step": False})],
                         ids=["host-overlapped", "ssd-overlapped", "host-speculative", "ssd-waiting"])
def test_every_rank_issues_the_same_collectives_in_the_same_order(where, extra, tmp_path):
    config = _config(DP, where, str(tmp_path), pinned=True, **extra)
    for seed in (1, 2):
        per_rank = run_distributed(_sequence, DP, config, seed, timeout=240)
        first = per_rank[0]
        assert len(first) > STEPS * 10 and {op for op, _, _ in first} >= {"all_gather", "reduce_scatter",
                                                                          "all_reduce"}
        for other in per_rank[1:]:
            assert other == first
