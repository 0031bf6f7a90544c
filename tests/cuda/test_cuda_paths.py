"""Paths only a GPU reaches (skipped without one; benchmarks/gpu_check.sh runs them on a GPU machine):
pinned host shards, NCCL collectives including group_all_reduce's host->device staging, the SSD tier
behind a CUDA compute device, the gathered-parameter arena in device memory, and pretrain_gpt.py
--deepspeed on a GPU (a dense and a mixture-of-experts GPT). fp32 with TF32 off throughout, compared with a
single-process fp32 reference on the same GPU (the ``reference`` fixture, tests/cuda/conftest.py)."""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.cuda.common import (
    CUDA,
    STEPS,
    WEIGHT_TOL,
    device_engine,
    gpu_only,
    offload_config,
    strict_fp32,
)
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import TINY_GPT
from tests.zero_cache.common import (
    GAS,
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    to_numpy,
    train_engine,
)
from zero_cache import storage_pointer
from zero_cache.comm import group_all_reduce, observe_collectives

pytestmark = gpu_only()
# A rank that hangs (NCCL) fails its test after this long, not after the default 3 minutes: the GPU time of a
# check is short. A healthy run takes seconds.
RANK_TIMEOUT = 60


def _host_states(engine) -> list[torch.Tensor]:
    """Every distinct state tensor in host memory (an fp32 master can be the parameter shard itself)."""
    seen, out = set(), []
    for c in engine.chunks:
        for t in (c.param_shard, c.master, c.grad, c.exp_avg, c.exp_avg_sq):
            if t is not None and t.device.type == "cpu" and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def test_pinned_host_offload_matches_fp32_reference(reference):
    ref_losses, ref_weights = reference
    _, engine = device_engine(offload_config())
    host = _host_states(engine)
    assert host and all(t.is_pinned() for t in host)
    assert sum(t.numel() * t.element_size() for t in host) == engine.memory_report().by_tier["host"]
    losses = train_engine(engine, batches(STEPS).to(CUDA), 0, 1)
    assert_close_losses(losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]
    assert_close_weights(engine.gather_state_dict(), ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
    assert all(t.is_pinned() for t in _host_states(engine))
    engine.close()


def _as_two_ranks():
    """One GPU holds one NCCL rank (NCCL refuses two ranks on one device), and group_all_reduce returns early
    for a group of one. Inside this block torch.distributed reports two members for any group, so the
    engine's group all-reduces (model-parallel norm, tied gradients) and their host->device staging run, on
    the real one-member NCCL group; summing over one member changes no value."""
    return mock.patch.object(dist, "get_world_size", lambda group=None: 2)


def _recorder(seen: list):
    """observe_collectives callback: (kind, device type, dtype, elements) of each collective."""
    return lambda kind, tensor, group, tag: seen.append((kind, tensor.device.type, str(tensor.dtype), tensor.numel()))


def _collectives_per_step(engine, device: torch.device) -> tuple[list[float], list[Counter]]:
    """Train STEPS steps with every group all-reduce running; the losses and each step's collectives."""
    seen: list = []
    losses, per_step = [], []
    data = batches(STEPS).to(device)
    with _as_two_ranks(), observe_collectives(_recorder(seen)):
        for s in range(STEPS):
            start = len(seen)
            losses += train_engine(engine, data, 0, 1, steps=[s])
            per_step.append(Counter(seen[start:]))
    return losses, per_step


def _by_kind_dtype_size(collectives: Counter) -> Counter:
    out = Counter()
    for (kind, _, dtype, numel), count in collectives.items():
        out[(kind, dtype, numel)] += count
    return out


def _nccl_group_of_one(rank: int, world_size: int) -> dict:
    torch.cuda.set_device(CUDA)
    strict_fp32()
    group = dist.group.WORLD
    out = {"backend": str(dist.get_backend(group))}

    seen: list = []
    triple = dist._make_nccl_premul_sum(3.0)  # an NCCL reduction that changes values, so the copy-back shows
    host, dev = torch.arange(1.0, 7.0), torch.arange(1.0, 7.0, device=CUDA)
    with _as_two_ranks(), observe_collectives(_recorder(seen)):
        group_all_reduce(host, group, op=triple, device=CUDA)
        group_all_reduce(dev, group, op=triple, device=CUDA)
    out["staging"] = {"host": host.tolist(), "host_device": host.device.type, "dev": dev.cpu().tolist(),
                      "seen": seen}

    # The engine over the NCCL group: data-parallel, model-parallel and tied-embedding group all = WORLD. A group
    # of one skips its collectives (Comm.active is False); they run on NCCL instead.
    model, engine = device_engine(offload_config(), CUDA, tied_group=group, dp_group=group,
                                  model_parallel_group=group)
    engine.comm.active = True
    tied = next(c for c in engine.chunks if any(s.param is model.embed.weight for s in c.plan.slots))
    out["losses"], out["per_step"] = _collectives_per_step(engine, CUDA)
    out["chunks"] = len(engine.chunks)
    out["held"] = len(engine.reducer.keep)  # chunks whose gradient buffer is held across micro-batches
    out["tied_shard"] = tied.plan.shard
    out["tied_grad_device"] = tied.grad.device.type
    out["weights"] = to_numpy(engine.gather_state_dict())
    engine.close()

    # The same engine on the CPU with the emulated accelerator (the same copy-stream code path), over a gloo
    # group of one run the same way: the collectives NCCL must have seen, step by step.
    gloo = dist.new_group(backend="gloo")
    emulated = offload_config(emulated_accelerator={"enabled": True, "h2d_gbps": 50.0, "d2h_gbps": 50.0})
    _, engine = device_engine(emulated, torch.device("cpu"), tied_group=gloo, dp_group=gloo,
                              model_parallel_group=gloo)
    engine.comm.active = True
    out["emulated_per_step"] = _collectives_per_step(engine, torch.device("cpu"))[1]
    engine.close()
    return out


@pytest.mark.multiprocess
def test_nccl_group_of_one_through_the_engine_comm_path(reference):
    ref_losses, ref_weights = reference
    (out,) = run_distributed(_nccl_group_of_one, 1, backend="nccl", timeout=RANK_TIMEOUT)
    assert out["backend"] == "nccl"
    st = out["staging"]
    assert st["host"] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0] and st["host_device"] == "cpu"  # reduced, copied back
    assert st["dev"] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
    assert [(k, d) for k, d, _, _ in st["seen"]] == [("all_reduce", "cuda"), ("all_reduce", "cuda")]  # host via GPU

    assert_close_losses(out["losses"], ref_losses)
    assert_close_weights(out["weights"], ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
    n, held = out["chunks"], out["held"]
    assert held >= 1  # fp32 buffers: the last chunk to complete is held into the next micro-batch
    for step, (got, emulated) in enumerate(zip(out["per_step"], out["emulated_per_step"]), 1):
        kinds = Counter()
        for (kind, device, _, _), count in got.items():
            assert device == "cuda", (step, kind)  # NCCL takes device memory only
            kinds[kind] += count
        # One reduce-scatter per chunk per micro-batch, one per step for the held ones (grad_reducer.py).
        assert kinds["reduce_scatter"] == GAS * n - (GAS - 1) * held, step
        # Sum of squares and overflow flag over the data-parallel and the model-parallel group (two float64), the
        # tied embedding's gradient shard over its group, staged through the GPU.
        assert got[("all_reduce", "cuda", "torch.float64", 2)] == 2, step
        assert got[("all_reduce", "cuda", "torch.float32", out["tied_shard"])] == 1, step
        assert kinds["all_reduce"] == 3 and kinds["broadcast"] == 0, step
        assert kinds["all_gather"] >= n, step  # every chunk at least once a step (gathers, resident refresh)
        assert _by_kind_dtype_size(got) == _by_kind_dtype_size(emulated), step  # exactly the emulated run's
    assert out["tied_grad_device"] == "cpu"  # so the tied all-reduce needed the staging


def test_ssd_tier_on_cuda_matches_fp32_reference(reference, tmp_path):
    ref_losses, ref_weights = reference
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    where = {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True}
    _, engine = device_engine(ds_config(3, 1, sub_group_size=600, offload_optimizer=dict(where),
                                        offload_param=dict(where)))
    losses = train_engine(engine, batches(STEPS).to(CUDA), 0, 1)
    report, swap = engine.memory_report(), engine.swap_stats()
    weights = engine.gather_state_dict()
    swap_dir = engine.store.directory
    engine.close()
    assert_close_losses(losses, ref_losses)
    assert_close_weights(weights, ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
    assert report.by_kind_tier.get(("optimizer", "nvme"), 0) > 0 and report.by_kind_tier.get(("params", "nvme"), 0) > 0
    assert swap.bytes_read > 0 and swap.bytes_written > 0
    assert not os.path.exists(swap_dir)  # page files removed at close


def test_param_arena_on_device_matches_fp32_reference(reference):
    """max_contigous_params_size on CUDA: two chunks' worth of device memory, evicted by the trace."""
    if storage_pointer.mechanism() is None:  # torch < 2.13 without a C++ compiler: the engine uses no arena
        pytest.skip(f"no gathered-parameter arena here: {storage_pointer.unavailable_reason()}")
    ref_losses, ref_weights = reference
    _, engine = device_engine(ds_config(3, 1, max_contigous_params_size=2304))
    losses = train_engine(engine, batches(STEPS).to(CUDA), 0, 1)
    arena = engine.coordinator.arena
    weights = engine.gather_state_dict()
    engine.close()
    assert arena is not None and arena.buffer.device.type == "cuda"
    assert 0 < arena.peak_used <= arena.numel < sum(c.plan.padded for c in engine.chunks if not c.plan.resident)
    assert_close_losses(losses, ref_losses)
    assert_close_weights(weights, ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)


def _train_on_gpu(rank: int, world_size: int, argv: list[str]) -> dict:
    strict_fp32()
    from pretrain_gpt import main

    result = main(argv)
    return {"losses": result.losses, "tiers": result.backend.memory_tiers(),
            "devices": sorted({p.device.type for p in result.model.parameters()})}


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--moe-aux-loss-coeff", "0.01"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", [[], MOE], ids=["dense", "moe"])
def test_trainer_deepspeed_on_gpu_matches_megatron_backend(tmp_path, model):
    argv = list(TINY_GPT) + model
    argv[argv.index("--distributed-backend") + 1] = "nccl"
    ds = tmp_path / "ds_zero3_offload.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "allgather_bucket_size": 3000, "stage3_param_persistence_threshold": 64, "sub_group_size": 5000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}}}))
    zero = ["--deepspeed", "--deepspeed_config", str(ds)]
    ddp, z32, z16 = (run_distributed(_train_on_gpu, 1, a, backend="nccl", timeout=RANK_TIMEOUT)[0]
                     for a in (argv, argv + zero, argv + zero + ["--bf16"]))
    ref = ddp["losses"]
    assert sorted(ref) == list(range(1, 11)) and ref[10] < ref[1]
    for run in (ddp, z32, z16):
        assert run["devices"] == ["cuda"]
    for it in ref:
        assert z32["losses"][it] == pytest.approx(ref[it], rel=1e-5), f"fp32 iteration {it}"
        assert math.isfinite(z16["losses"][it]) and z16["losses"][it] == pytest.approx(ref[it], rel=5e-2), \
            f"bf16 iteration {it}"
    assert z16["losses"][10] < z16["losses"][1]
    assert z32["tiers"]["host states"] > 0 and z16["tiers"]["host states"] > 0
