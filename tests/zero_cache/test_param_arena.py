"""max_contigous_params_size: gathered chunks carved from one preallocated buffer, evicted by the trace.

The arena moves chunks between regions while parameters (and tensors autograd saved) stay views of the
chunk's storage, so training must equal the fp32 reference whatever the arena evicts. A chunk stays cached
until it is evicted, so an arena that holds every chunk gathers each chunk once per step."""
from __future__ import annotations

import pytest
import torch

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    make_model,
    reference_run,
    to_numpy,
    train_engine,
)
from zero_cache.chunk import FlatChunk
from zero_cache.chunk_collectives import ChunkCollectives
from zero_cache.comm import Comm, CommProfiler
from zero_cache.param_arena import ParamArena, region_numel
from zero_cache.partition import ChunkPlan

DP, STEPS = 2, 4


def _chunk(index: int, numel: int) -> tuple[FlatChunk, torch.Tensor]:
    """A released chunk and a view of it taken while it was allocated (as parameters and saved tensors are)."""
    plan = ChunkPlan(index, 0, False, numel=numel, padded=numel, shard=numel)
    chunk = FlatChunk(plan, ChunkCollectives(Comm(None, CommProfiler(False))), torch.empty(numel), 1.0)
    view = chunk.full[10:20]
    chunk.free_full()
    return chunk, view


def test_regions_move_under_views_and_coalesce():
    arena = ParamArena(3 * 64, torch.float32, torch.device("cpu"))  # three 256-byte regions
    (a, saved), (b, _), (c, _) = _chunk(0, 64), _chunk(1, 64), _chunk(2, 100)
    assert arena.place(a) and arena.place(b)
    a.full.copy_(torch.arange(64.0))
    assert torch.equal(saved, torch.arange(10.0, 20.0))
    assert arena.buffer[:64].equal(torch.arange(64.0))  # a sits in the buffer, not in an allocation of its own
    assert arena.place(c) is False  # c takes 128 elements (aligned up); 64 are free
    arena.remove(a)
    assert a.full.untyped_storage().nbytes() == 0
    assert arena.place(c) is False  # 128 free, but not in one piece
    arena.remove(b)
    assert arena.largest_free() == 3 * 64  # the freed regions coalesced with the free tail
    assert arena.place(c) and arena.place(a)
    a.full.fill_(7.0)
    assert torch.equal(saved, torch.full((10,), 7.0))  # the same view follows the chunk to its new region
    assert arena.buffer[128:].equal(torch.full((64,), 7.0))
    assert arena.used == region_numel(100, 4) + 64 == arena.peak_used


def _train(rank, world_size, arena: int, checkpointing: bool, params_on_ssd: str):
    extra = {"max_contigous_params_size": arena, "is_communication_time_profiling": True}
    if params_on_ssd:
        extra["offload_param"] = extra["offload_optimizer"] = {"device": "nvme", "nvme_path": params_on_ssd}
    model = make_model(activation_checkpointing=checkpointing)
    engine = zero_cache.initialize(model=model, config=ds_config(3, world_size, **extra))
    engine.register_external_parameter(model.head, model.embed.weight)
    partitioned = [c.index for c in engine.chunks if not c.plan.resident]
    gathers = []
    losses = []
    for s in range(STEPS):
        losses += train_engine(engine, batches(STEPS), rank, world_size, steps=[s])
        gathers.append(sum(1 for e in engine.profiler.events if e.op == "all_gather" and e.tag.startswith("chunk")
                           and int(e.tag[5:]) in partitioned))
        engine.profiler.events.clear()
    report = engine.memory_report()
    regions = [region_numel(engine.chunks[c].plan.padded, 4) for c in partitioned]
    out = {"losses": losses, "weights": to_numpy(engine.gather_state_dict()), "gathers": gathers,
           "peak": report.gathered_peak, "reserved": report.gathered_reserved, "need": sum(regions),
           "largest": max(regions), "chunks": len(partitioned),
           "chunk_bytes": sum(engine.chunks[c].full_nbytes() for c in partitioned)}
    engine.close()
    return out


def _global_losses(per_rank) -> list[float]:
    return [sum(r["losses"][s] for r in per_rank) / DP for s in range(STEPS)]


@pytest.mark.parametrize("checkpointing,params_on_ssd", [(False, False), (True, False), (True, True)],
                         ids=["saved-tensors", "recompute", "recompute-params-on-ssd"])
@pytest.mark.multiprocess
def test_small_arena_trains_like_reference(tmp_path, checkpointing, params_on_ssd):
    """An arena of two of the largest chunks (the planner's choice) forces evictions every step."""
    ref_losses, ref_weights = reference_run(STEPS, activation_checkpointing=checkpointing)
    arena = 2 * region_numel(1100, 4)  # ds_config packs chunks of at most 1100 elements
    nvme = str(tmp_path) if params_on_ssd else ""
    per_rank = run_distributed(_train, DP, arena, checkpointing, nvme, timeout=180)
    assert_close_losses(_global_losses(per_rank), ref_losses)
    for r in per_rank:
        assert r["largest"] <= arena // 2 and r["need"] > 2 * arena  # most chunks are evicted and gathered again
        assert r["reserved"] == arena * 4 and 0 < r["peak"] <= r["reserved"]
    assert_close_weights(per_rank[0]["weights"], ref_weights[-1])  # gather_state_dict: on rank 0


@pytest.mark.multiprocess
def test_arena_holding_every_chunk_gathers_each_once_per_step():
    ref_losses, ref_weights = reference_run(STEPS, activation_checkpointing=True)
    # Without the arena every chunk is gathered for forward, recomputation and backward of each micro-batch.
    plain = run_distributed(_train, DP, -1, True, "", timeout=180)
    cached = run_distributed(_train, DP, 1 << 20, True, "", timeout=180)
    r = cached[0]
    assert r["gathers"] == [r["chunks"]] * STEPS and all(g > 2 * r["chunks"] for g in plain[0]["gathers"])
    assert r["peak"] == r["chunk_bytes"]  # every chunk stayed gathered once
    assert_close_losses(_global_losses(cached), ref_losses)
    assert_close_losses(_global_losses(plain), ref_losses)
    assert_close_weights(r["weights"], ref_weights[-1])


def test_arena_smaller_than_one_module_is_a_clear_error():
    with pytest.raises(zero_cache.ZeroConfigError,
                       match=r"'zero_optimization.max_contigous_params_size' 576 elements cannot hold the chunks "
                             r"one (Embedding|Linear) module uses at once \(\d+ elements\); raise it"):
        zero_cache.initialize(model=make_model(), config=ds_config(3, 1, max_contigous_params_size=600))
