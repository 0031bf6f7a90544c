"""Gloo's point-to-point all-gather and reduce-scatter (comm.py) against gloo's own collectives.

Several collectives are in flight at once, interleaved with a collective on the same group, as the
engine's prefetch and gradient reduction issue them; 3 ranks check an odd world size."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from zero_cache.comm import Comm, CommProfiler

pytestmark = pytest.mark.multiprocess

SHARD = 1000  # elements per rank


def _run(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    p2p = Comm(group, CommProfiler(True), p2p_on_gloo=True)
    native = Comm(group, CommProfiler(False), p2p_on_gloo=False)
    assert p2p.p2p and not native.p2p
    g = torch.Generator().manual_seed(rank)
    shards = [torch.randn(SHARD * (k + 1), generator=g) for k in range(3)]
    fulls = [torch.randn(SHARD * world_size * (k + 1), generator=g) for k in range(3)]

    # Everything in flight before any wait, with a gloo all-reduce issued in between.
    gathered = [torch.full((s.numel() * world_size,), float("nan")) for s in shards]
    reduced = [torch.full((f.numel() // world_size,), float("nan")) for f in fulls]
    handles = [p2p.all_gather(o, s, async_op=True) for o, s in zip(gathered, shards)]
    handles += [p2p.reduce_scatter(o, f, async_op=True) for o, f in zip(reduced, fulls)]
    total = torch.tensor([float(rank)])
    p2p.all_reduce(total)
    for h in reversed(handles):
        h.wait()

    # In place: the shard is this rank's piece of the output (the engine's re-gather after a step).
    inplace = torch.zeros(SHARD * world_size)
    inplace.chunk(world_size)[rank].copy_(shards[0])
    p2p.all_gather(inplace, inplace.chunk(world_size)[rank])

    ref_gathered = [torch.empty_like(o) for o in gathered]
    ref_reduced = [torch.empty_like(o) for o in reduced]
    for o, s in zip(ref_gathered, shards):
        native.all_gather(o, s)
    for o, f in zip(ref_reduced, fulls):
        native.reduce_scatter(o, f)
    profiled = [(e.op, e.nbytes) for e in p2p.profiler.events]
    return dict(gathered=gathered, reduced=reduced, ref_gathered=ref_gathered, ref_reduced=ref_reduced,
                inplace=inplace, total=total.item(), profiled=profiled, shards=shards, fulls=fulls)


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_collectives_equal_gloo(world_size):
    outs = run_distributed(_run, world_size, timeout=120)
    for o in outs:
        assert o["total"] == sum(range(world_size))
        for got, ref in zip(o["gathered"], o["ref_gathered"]):
            assert torch.equal(got, ref)
        torch.testing.assert_close(o["inplace"], o["ref_gathered"][0], rtol=0, atol=0)
        for got, ref in zip(o["reduced"], o["ref_reduced"]):
            # Two ranks: a + b either way; three: gloo's ring may add in another order.
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
            if world_size == 2:
                assert torch.equal(got, ref)
        assert [op for op, _ in o["profiled"]] == ["all_gather"] * 3 + ["reduce_scatter"] * 3 + \
            ["all_reduce", "all_gather"]
    # Against the definitions: the concatenation of every rank's shard, and every rank's piece of the sum.
    for k in range(3):
        assert torch.equal(outs[0]["gathered"][k], torch.cat([o["shards"][k] for o in outs]))
        total = sum(o["fulls"][k] for o in outs)
        torch.testing.assert_close(torch.cat([o["reduced"][k] for o in outs]), total, rtol=1e-6, atol=1e-6)


def _peer_gone(rank, world_size):
    """Rank 1 leaves without taking part; rank 0's point-to-point all-gather must fail, not hang."""
    # Both ranks finish connecting first: a rank 1 that left while rank 0 was still in gloo's connection setup
    # would fail rank 0 inside init_process_group instead, before the exchange this test is about.
    dist.barrier()
    if rank == 1:
        return None
    comm = Comm(None, CommProfiler(False), p2p_on_gloo=True)
    start = time.monotonic()
    try:
        comm.all_gather(torch.empty(2 * SHARD), torch.ones(SHARD))
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    return None


def test_a_peer_that_is_gone_is_an_error_not_a_hang():
    # The process group's timeout (120 s) would end a hang with an error too: only failing fast passes.
    elapsed, message = run_distributed(_peer_gone, 2, timeout=120)[0]
    assert elapsed < 20, f"took {elapsed:.1f} s: the exchange waited for the timeout instead of failing ({message})"
    assert "timed out" not in message.lower() and "timeout" not in message.lower(), message
