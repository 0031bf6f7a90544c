"""Hierarchical ZeRO-3 on 4 ranks laid out as 2 hosts x 2 (LOCAL_WORLD_SIZE=2): flat ZeRO-3's two-hop gloo
collectives, MiCS/HSDP shard groups and hpZ secondary shards give the single-process reference's losses and
weights (fp32, 1e-5); quantized gathers and gradients (qwZ, qgZ, qgZ with error feedback) stay close to it, and
error feedback carries qgZ's rounding error forward; every layout issues its
collectives in the same order on every rank whatever the timing; a checkpoint moves between flat and
hierarchical layouts; a shard size that does not divide the group is refused."""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    make_engine,
    reference_run,
    to_numpy,
    train_engine,
)
from zero_cache import comm as zcomm

pytestmark = pytest.mark.multiprocess

WORLD, STEPS = 4, 3
LAYOUTS = {
    "flat": {},
    "mics": {"mics_shard_size": 2},
    "mics-host": {"mics_shard_size": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "hpz": {"zero_hpz_partition_size": 2},
    "qwz": {"zero_quantized_weights": True, "quantization_block_size": 64},
    "qgz": {"zero_quantized_gradients": True, "quantization_block_size": 64},
    "qgz-ef": {"zero_quantized_gradients": True, "quantization_block_size": 64,
               "quantized_gradients_error_feedback": True},
    "zeropp": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True,
               "quantization_block_size": 64},
}


def _train(rank, world, layouts, delays):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = {}
    for name in layouts:
        engine = make_engine(ds_config(3, world, **LAYOUTS[name]))
        seen = []
        rng = random.Random(rank)

        def observe(kind, tensor, group, tag, seen=seen, rng=rng):
            ranks = tuple(torch.distributed.get_process_group_ranks(group or torch.distributed.group.WORLD))
            seen.append((kind, tag, ranks, tensor.numel(), str(tensor.dtype)))
            if delays:  # ranks reach their collectives at different times: the order must not depend on it
                time.sleep(rng.random() * 0.002)
        with zcomm.observe_collectives(observe):
            losses = train_engine(engine, batches(STEPS), rank, world)
        weights = to_numpy(engine.gather_state_dict())  # collective
        out[name] = (losses, weights if rank == 0 else None, seen, len(engine.chunks))
    return out


def _mean_losses(results, name) -> list[float]:
    """The global batch's loss per step: the mean of the ranks' (equal shares of the batch)."""
    return [sum(r[name][0][s] for r in results) / WORLD for s in range(STEPS)]


@pytest.fixture(scope="module")
def reference():
    return reference_run(STEPS)


def _groups(seen, kind) -> set:
    return {e[2] for e in seen if e[0] == kind and e[1].startswith("chunk")}


def _assert_same_order(results, name) -> None:
    """Every group's collectives come in one order, with the same sizes, on each of its members."""
    per_group: dict = {}
    for r, out in enumerate(results):
        for e in out[name][2]:
            per_group.setdefault((e[2], r), []).append((e[0], e[1], e[3]))
    for (group, r), events in per_group.items():
        first = per_group[(group, group[0])]
        assert events == first, f"{name}: rank {r} issued another sequence over {group} than its first member"


def test_two_hop_collectives_shard_groups_and_secondary_shards_equal_the_reference(reference):
    ref_losses, ref_weights = reference
    results = run_distributed(_train, WORLD, ["flat", "mics", "mics-host", "hpz"], True, timeout=90)
    for name in ("flat", "mics", "mics-host", "hpz"):
        assert_close_losses(_mean_losses(results, name), ref_losses)
        assert_close_weights(results[0][name][1], ref_weights[-1])
        _assert_same_order(results, name)
    flat, mics, hpz = (results[0][n][2] for n in ("flat", "mics", "hpz"))
    # Flat across 2 hosts on gloo: gathers across hosts {0, 2} then in the node {0, 1}, reductions the other way
    # round (the whole group only for the resident chunks' refresh after the step)
    assert _groups(flat, "all_gather") == {(0, 2), (0, 1), (0, 1, 2, 3)}
    assert _groups(flat, "reduce_scatter") == {(0, 1), (0, 2)}
    # MiCS: gathers and reduce-scatters inside rank 0's block {0, 1}; each shard all-reduced across the blocks
    # {0, 2} once a step, whatever the micro-batches
    assert _groups(mics, "all_gather") == _groups(mics, "reduce_scatter") == {(0, 1)}
    across = [e for e in mics if e[0] == "all_reduce" and e[2] == (0, 2)]
    assert len(across) == STEPS * results[0]["mics"][3]
    # hpZ: the step's first gather in two hops, the later ones from the secondary shards in the node {0, 1}
    hops = [e[2] for e in hpz if e[0] == "all_gather" and e[1].startswith("chunk") and e[2] != (0, 1, 2, 3)]
    assert hops.count((0, 1)) > hops.count((0, 2)) > 0
    assert _groups(hpz, "reduce_scatter") == {(0, 1), (0, 2)}


def test_quantized_collectives_stay_close(reference):
    ref_losses, _ = reference
    results = run_distributed(_train, WORLD, ["qwz", "qgz", "qgz-ef", "zeropp"], False, timeout=90)
    for name in ("qwz", "qgz", "qgz-ef", "zeropp"):
        losses = _mean_losses(results, name)
        assert_close_losses(losses, ref_losses, rel=1e-2)
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) > 1e-7  # quantized: not the exact run
        _assert_same_order(results, name)
    qwz, qgz, zeropp = (results[0][n][2] for n in ("qwz", "qgz", "zeropp"))
    # partitioned chunks' gathers are int8 (resident chunks' refresh after the step stays exact)
    assert "torch.uint8" in {e[4] for e in qwz if e[0] == "all_gather" and e[1].startswith("chunk")}
    # qgZ: a full-precision reduce-scatter in the node {0, 1}, then int8 pieces across hosts {0, 2}
    assert _groups(qgz, "reduce_scatter") == {(0, 1), (0, 2)}
    assert {e[4] for e in qgz if e[0] == "reduce_scatter" and e[2] == (0, 2)} == {"torch.uint8"}
    assert {e[4] for e in qgz if e[0] == "reduce_scatter" and e[2] == (0, 1)} == {"torch.float32"}
    assert _groups(zeropp, "all_gather") == {(0, 1, 2, 3), (0, 2), (0, 1)}


def _save_and_resume(rank, world, ckpt_dir, save_layout, load_layout):
    """Steps 1-2 under ``save_layout``, a checkpoint, steps 3-4 under ``load_layout`` from another init."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    engine = make_engine(ds_config(3, world, **LAYOUTS.get(save_layout, {})))
    first = train_engine(engine, batches(4), rank, world, steps=range(2))
    engine.save_checkpoint(ckpt_dir, client_state={"iteration": 2})
    engine.close()
    engine = make_engine(ds_config(3, world, **LAYOUTS.get(load_layout, {})), seed=123)
    engine.load_checkpoint(ckpt_dir)
    second = train_engine(engine, batches(4), rank, world, steps=range(2, 4))
    weights = to_numpy(engine.gather_state_dict())
    engine.close()
    return first + second, weights if rank == 0 else None


@pytest.mark.parametrize("save_layout,load_layout", [("mics", "flat"), ("flat", "mics")])
def test_checkpoint_moves_between_flat_and_hierarchical(tmp_path, save_layout, load_layout):
    ref_losses, ref_weights = reference_run(4)
    results = run_distributed(_save_and_resume, WORLD, str(tmp_path / "ckpt"), save_layout, load_layout, timeout=90)
    assert_close_losses([sum(r[0][s] for r in results) / WORLD for s in range(4)], ref_losses)
    assert_close_weights(results[0][1], ref_weights[-1])


def _refused(rank, world):
    from zero_cache.config import ZeroConfigError
    try:
        make_engine(ds_config(3, world, mics_shard_size=3))
    except ZeroConfigError as e:
        return str(e)
    return None


def test_a_shard_size_that_does_not_divide_the_group_is_refused_on_every_rank():
    messages = run_distributed(_refused, WORLD, timeout=60)
    assert messages == [messages[0]] * WORLD
    assert "'zero_optimization.mics_shard_size' 3 does not divide the data-parallel size 4" in messages[0]


def _reduce_repeatedly(rank, world, error_feedback, rounds):
    """One gradient reduce-scattered ``rounds`` times by qgZ (2 hosts x 2 ranks, int4): the sum of the results
    and the exact sum of the rounds."""
    import torch.distributed as dist

    from zero_cache.chunk_collectives import ChunkCollectives
    from zero_cache.comm import Comm, CommProfiler

    groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    node, cross = groups[rank // 2], groups[2 + rank % 2]
    profiler = CommProfiler(False)
    collectives = ChunkCollectives(Comm(dist.group.WORLD, profiler), node=Comm(node, profiler),
                                   cross=Comm(cross, profiler), quantize_grads=True, block=64, grad_bits=4,
                                   error_feedback=error_feedback)
    full = torch.randn(1024, generator=torch.Generator().manual_seed(rank))
    total = torch.zeros(256)
    for _ in range(rounds):
        out = torch.empty(256)
        collectives.reduce_scatter(out, full, tag="chunk0").wait()
        total += out
    exact = torch.empty(256)
    dist.reduce_scatter(exact, list(full.chunk(world)))
    return (total - rounds * exact).abs().max().item(), exact.abs().max().item()


def test_error_feedback_carries_the_quantization_error_forward():
    """Eight reductions of one gradient: without error feedback the int4 errors of all eight add up in the sum;
    with it the sum's error stays about that of one reduction."""
    plain = run_distributed(_reduce_repeatedly, WORLD, False, 8, timeout=60)
    carried = run_distributed(_reduce_repeatedly, WORLD, True, 8, timeout=60)
    one = run_distributed(_reduce_repeatedly, WORLD, False, 1, timeout=60)
    for (p, scale), (c, _), (o, _) in zip(plain, carried, one):
        assert p > 4 * o > 0  # without: eight times the same error
        assert c < 2 * o and c < p / 4, (p, c, o)
        assert o < 0.2 * scale  # int4 blocks: a few percent of the largest value
