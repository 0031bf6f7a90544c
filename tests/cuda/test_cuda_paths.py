"""Paths only a GPU reaches (skipped without one; benchmarks/gpu_check.sh runs them on a GPU machine):
pinned host shards, NCCL collectives including group_all_reduce's host->device staging, the SSD tier
behind a CUDA compute device, the gathered-parameter arena in device memory, and pretrain_gpt.py
--deepspeed on a GPU. fp32 with TF32 off throughout,
compared with a single-process fp32 reference on the same GPU."""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import zero_cache
from tests.cuda.common import device_reference, make_device_model
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
from zero_cache import comm as zc_comm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)")

STEPS = 5
CUDA = torch.device("cuda", 0)
WEIGHT_TOL = 1e-4  # final weights after 5 AdamW steps: CPU (engine) vs CUDA (reference) Adam arithmetic


def _strict_fp32() -> None:
    """fp32 matmuls without TF32, so that the engine and the reference compute the same thing (the models
    here have no convolutions, so cuDNN's flag does not matter)."""
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture(scope="module", autouse=True)
def strict_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32
    _strict_fp32()
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def reference():
    return device_reference(CUDA, STEPS)


def _offload_config() -> dict:
    """Stage 3, parameters and optimizer states in pinned host memory."""
    cfg = ds_config(3, 1, offload=True)
    for key in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][key]["pin_memory"] = True
    return cfg


def _engine(config: dict, tied_group=None, **kw):
    model = make_device_model(CUDA)
    tied = [(model.embed.weight, tied_group)] if tied_group is not None else None
    engine = zero_cache.initialize(model=model, config=config, tied_param_groups=tied, **kw)
    engine.register_external_parameter(model.head, model.embed.weight)
    return model, engine


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
    _, engine = _engine(_offload_config())
    host = _host_states(engine)
    assert host and all(t.is_pinned() for t in host)
    assert sum(t.numel() * t.element_size() for t in host) == engine.memory_report().by_tier["host"]
    losses = train_engine(engine, batches(STEPS).to(CUDA), 0, 1)
    assert_close_losses(losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]
    assert_close_weights(engine.gather_state_dict(), ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
    assert all(t.is_pinned() for t in _host_states(engine))
    engine.close()


class _DistSpy:
    """torch.distributed as zero_cache.comm sees it: collectives are recorded (kind, tensor device) and run.

    Groups report two members: one GPU cannot host a second NCCL rank, and group_all_reduce returns early
    for a group of one, so this is how its host->device staging branch runs through a real NCCL all-reduce."""

    KINDS = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "broadcast": "broadcast"}

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def get_world_size(self, group=None) -> int:
        return 2

    def __getattr__(self, name):
        fn = getattr(dist, name)
        kind = self.KINDS.get(name)
        if kind is None:
            return fn

        def recorded(tensor, *args, **kwargs):
            self.calls.append((kind, tensor.device.type))
            return fn(tensor, *args, **kwargs)
        return recorded


def _nccl_group_of_one(rank: int, world_size: int) -> dict:
    torch.cuda.set_device(CUDA)
    _strict_fp32()
    group = dist.group.WORLD
    out = {"backend": str(dist.get_backend(group))}
    spy = _DistSpy()
    triple = dist._make_nccl_premul_sum(3.0)  # an NCCL reduction that changes values, so the copy-back shows
    host, dev = torch.arange(1.0, 7.0), torch.arange(1.0, 7.0, device=CUDA)
    with mock.patch.object(zc_comm, "dist", spy):
        zc_comm.group_all_reduce(host, group, op=triple, device=CUDA)
        zc_comm.group_all_reduce(dev, group, op=triple, device=CUDA)
    out["staging"] = {"host": host.tolist(), "host_device": host.device.type, "dev": dev.cpu().tolist(),
                      "calls": list(spy.calls)}
    spy.calls.clear()

    # The engine over the NCCL group: data-parallel, model-parallel and tied-embedding group all = WORLD.
    model, engine = _engine(_offload_config(), tied_group=group, dp_group=group, model_parallel_group=group)
    tied = next(c for c in engine.chunks if any(s.param is model.embed.weight for s in c.plan.slots))
    engine.comm.active = True  # a group of one skips its collectives; run them on NCCL instead
    with mock.patch.object(zc_comm, "dist", spy):
        out["losses"] = train_engine(engine, batches(STEPS).to(CUDA), 0, 1)
    out["counts"] = dict(Counter(kind for kind, _ in spy.calls))
    out["devices"] = sorted({d for _, d in spy.calls})
    out["chunks"] = len(engine.chunks)
    out["tied_grad_device"] = tied.grad.device.type
    out["weights"] = to_numpy(engine.gather_state_dict())
    engine.close()
    return out


def test_nccl_group_of_one_through_the_engine_comm_path(reference):
    ref_losses, ref_weights = reference
    (out,) = run_distributed(_nccl_group_of_one, 1, backend="nccl", timeout=180)
    assert out["backend"] == "nccl"
    st = out["staging"]
    assert st["host"] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0] and st["host_device"] == "cpu"  # reduced, copied back
    assert st["dev"] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
    assert st["calls"] == [("all_reduce", "cuda"), ("all_reduce", "cuda")]  # the host tensor went via the GPU

    assert_close_losses(out["losses"], ref_losses)
    assert_close_weights(out["weights"], ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
    counts, n = out["counts"], out["chunks"]
    assert counts["reduce_scatter"] == STEPS * GAS * n  # one per chunk per micro-batch
    assert counts["all_gather"] >= STEPS * n  # every chunk at least once a step (gather or resident refresh)
    assert counts["all_reduce"] >= 3 * STEPS  # grad norm on the DP group and the MP group, tied embedding grads
    assert out["devices"] == ["cuda"]
    assert out["tied_grad_device"] == "cpu"  # so the tied all-reduce needed the staging


def test_ssd_tier_on_cuda_matches_fp32_reference(reference, tmp_path):
    ref_losses, ref_weights = reference
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    where = {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True}
    _, engine = _engine(ds_config(3, 1, sub_group_size=600, offload_optimizer=dict(where), offload_param=dict(where)))
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
    ref_losses, ref_weights = reference
    _, engine = _engine(ds_config(3, 1, max_contigous_params_size=2304))
    losses = train_engine(engine, batches(STEPS).to(CUDA), 0, 1)
    arena = engine.coordinator.arena
    weights = engine.gather_state_dict()
    engine.close()
    assert arena.buffer.device.type == "cuda" and arena.peak_used <= arena.numel
    assert_close_losses(losses, ref_losses)
    assert_close_weights(weights, ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)


def _train_on_gpu(rank: int, world_size: int, argv: list[str]) -> dict:
    _strict_fp32()
    from pretrain_gpt import main

    result = main(argv)
    return {"losses": result.losses, "tiers": result.backend.memory_tiers(),
            "devices": sorted({p.device.type for p in result.model.parameters()})}


def test_trainer_deepspeed_on_gpu_matches_megatron_backend(tmp_path):
    argv = list(TINY_GPT)
    argv[argv.index("--distributed-backend") + 1] = "nccl"
    ds = tmp_path / "ds_zero3_offload.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "allgather_bucket_size": 3000, "stage3_param_persistence_threshold": 64, "sub_group_size": 5000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}}}))
    zero = ["--deepspeed", "--deepspeed_config", str(ds)]
    ddp, z32, z16 = (run_distributed(_train_on_gpu, 1, a, backend="nccl", timeout=240)[0]
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
