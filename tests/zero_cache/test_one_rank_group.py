"""A shard group of one rank (a single process here; the experts' group when EP equals DP) has nothing to gather or
reduce: the engine uses the shards as they are. A chunk in compute memory is "gathered" by pointing its full buffer
at its parameter shard, and the layers write their gradients straight into the gradient shard, which is multiplied
by the group's factor once per step; no collective (and so no chunk-sized copy) runs, on any tier, and training
matches the reference."""
from __future__ import annotations

import pytest
import torch

import zero_cache
from tests.zero_cache.common import (
    GAS,
    assert_close_losses,
    batches,
    ds_config,
    make_engine,
    make_model,
    rank_micro_batches,
    reference_run,
    train_engine,
)
from zero_cache.comm import Comm

STEPS = 3


def _config(tier: str, nvme: str) -> dict:
    cfg = ds_config(3, 1, offload=tier == "host", stage3_param_persistence_threshold=0)
    if tier == "nvme":
        for key in ("offload_optimizer", "offload_param"):
            cfg["zero_optimization"][key] = {"device": "nvme", "nvme_path": nvme}
    return cfg


@pytest.fixture
def collectives(monkeypatch) -> dict[str, int]:
    """Calls of the engine's all-gathers and reduce-scatters (a group of one makes each a chunk-sized copy)."""
    calls = {"all_gather": 0, "reduce_scatter": 0}
    for kind in calls:
        original = getattr(Comm, kind)

        def spy(self, *args, _original=original, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(Comm, kind, spy)
    return calls


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_one_rank_group_trains_like_the_reference_without_collectives(tier, tmp_path, collectives):
    ref_losses, _ = reference_run(STEPS, fused=True)
    engine = make_engine(_config(tier, str(tmp_path)), fused=True)
    losses = train_engine(engine, batches(STEPS), 0, 1)
    report = engine.memory_report()
    engine.close()
    assert_close_losses(losses, ref_losses)
    assert collectives["reduce_scatter"] == 0
    if tier == "nvme":  # a shard read from SSD is copied into the chunk's buffer
        assert collectives["all_gather"] > 0
    else:  # the shard is the gathered chunk
        assert collectives["all_gather"] == 0
        assert report.gathered_peak == 0


def test_gathered_parameters_are_views_of_the_shard(tmp_path):
    engine = make_engine(_config("device", str(tmp_path)), fused=True)
    seen = []
    chunk = engine.chunks[0]
    shard = chunk.param_shard
    param = chunk.plan.slots[0].param
    module = next(m for m in engine.module.modules() if any(p is param for p in m.parameters(recurse=False)))
    hook = module.register_forward_hook(lambda *_: seen.append(param.data_ptr() - shard.data_ptr()))
    engine.backward(engine(batches(1)[0][:2]))
    hook.remove()
    engine.close()
    assert seen == [chunk.plan.slots[0].offset * shard.element_size()]


@pytest.mark.parametrize("passes", [1, GAS, GAS + 1])
def test_group_factor_applies_once_to_the_sum_of_every_pass(passes, tmp_path):
    """The gradient shard sums the passes unscaled and is multiplied once: at the step when it comes before the
    pass the engine expected to be the last, and again right when a pass comes after that one."""
    factor = 0.25
    data = batches(1)[0]
    micro = (rank_micro_batches(data, 0, 1) * 2)[:passes]
    model = make_model(fused=True)
    for mb in micro:
        (model(mb) / GAS).backward()
    ref_norm = factor * torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()

    cfg = _config("device", str(tmp_path))
    model = make_model(fused=True)
    engine = zero_cache.initialize(model=model, config=cfg, param_groups=[
        {"params": list(model.parameters()), "gradient_scaling_factor": factor}])
    engine.register_external_parameter(model.head, model.embed.weight)
    for mb in micro:
        engine.backward(engine(mb))
    norm = engine.step().grad_norm
    engine.close()
    assert norm == pytest.approx(ref_norm, rel=1e-5)
