"""One budget over device, host and SSD: host states spill to SSD beyond the host budget (numerics equal the
fp32 reference, DP=2), accounted peaks stay within every budget, process RSS stays within the budgets plus a
stated overhead, and placements that cannot fit are one clear error."""
from __future__ import annotations

import gc
import os

import psutil
import pytest
import torch
from torch import nn

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    STEPS,
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    make_model,
    reference_run,
    to_numpy,
    train_engine,
)
from zero_cache.config import ZeroConfigError

DP = 2
HOST_BUDGET = 43_000  # bytes: a little less than the tiny model's host-tier states need at DP=2 (about 44 KB)


def _spill_config(world_size, nvme, host_budget=HOST_BUDGET, pipeline=True):
    return ds_config(3, world_size, sub_group_size=600, pipeline_optimizer=pipeline,
                     offload_optimizer={"device": "cpu", "nvme_path": nvme},
                     memory_budget={"host": host_budget, "device": 1 << 20, "nvme": 1 << 20})


def _spill(rank, world_size, nvme):
    out = {}
    for pipeline in (True, False):
        model = make_model()
        engine = zero_cache.initialize(model=model, config=_spill_config(world_size, nvme, pipeline=pipeline))
        engine.register_external_parameter(model.head, model.embed.weight)
        losses = train_engine(engine, batches(), rank, world_size)
        out[pipeline] = {"losses": losses, "weights": to_numpy(engine.gather_state_dict()),
                         "report": engine.memory_report(), "tiers": [c.opt_tier for c in engine.chunks]}
        engine.close()
    return out


@pytest.fixture(scope="module")
def spill_results(tmp_path_factory):
    return run_distributed(_spill, DP, str(tmp_path_factory.mktemp("nvme")), timeout=240)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "plain"])
def test_host_budget_spills_to_ssd_and_matches_reference(spill_results, pipeline):
    ref_losses, ref_weights = reference_run()
    losses = [sum(r[pipeline]["losses"][s] for r in spill_results) / DP for s in range(STEPS)]
    assert_close_losses(losses, ref_losses)
    assert_close_weights(spill_results[0][pipeline]["weights"], ref_weights[-1])
    for r in spill_results:
        res = r[pipeline]
        tiers, rep = res["tiers"], res["report"]
        assert "host" in tiers and "nvme" in tiers  # part stays on the host, the rest spilled
        assert tiers == sorted(tiers, key=lambda t: t == "nvme")  # the last sub-groups spill
        assert rep.by_kind_tier[("optimizer", "host")] > 0 and rep.by_kind_tier[("optimizer", "nvme")] > 0
        for tier, budget in rep.budget.items():  # accounted peaks (host: shards + staging buffers)
            assert rep.peak_by_tier.get(tier, 0) <= budget, (tier, rep.peak_by_tier, rep.budget)
        assert rep.budget["host"] == HOST_BUDGET and rep.swap_buffers_peak > 0


def test_impossible_placements_are_clear_errors(tmp_path):
    model = make_model()
    cfg = ds_config(3, 1, offload_optimizer={"device": "cpu"}, prefetch_cache_sub_group_rate=1.0,
                    memory_budget={"device": 10_000})
    with pytest.raises(ZeroConfigError, match=r"need \d+ bytes on the device tier but its budget is 10000 bytes; lower "
                                          r"prefetch_cache_sub_group_rate"):
        zero_cache.initialize(model=model, config=cfg)
    cfg = ds_config(3, 1, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)},
                    memory_budget={"host": 1000})
    with pytest.raises(ZeroConfigError, match=r"on the host tier but its budget is 1000 bytes"):
        zero_cache.initialize(model=model, config=cfg)
    cfg = ds_config(3, 1, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)},
                    memory_budget={"nvme": 1000})
    with pytest.raises(ZeroConfigError, match=r"on the nvme tier but its budget is 1000 bytes; free disk space"):
        zero_cache.initialize(model=model, config=cfg)


def test_default_budgets_come_from_the_machine(tmp_path):
    model = make_model()
    engine = zero_cache.initialize(model=model, config=ds_config(
        3, 1, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)}))
    avail = psutil.virtual_memory().available
    b = engine.memory_report().budget
    assert 0.3 * avail < b["host"] <= 0.45 * avail * 1.1 and 0.3 * avail < b["device"] <= 0.45 * avail * 1.1
    assert 0 < b["nvme"] <= psutil.disk_usage(str(tmp_path)).free
    engine.close()


# ---- RSS ---------------------------------------------------------------------------------------------------
RSS_OVERHEAD = 64 << 20  # activations, gathered chunks, reduce buffers, allocator slack, thread stacks


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])  # 16.8M params: 268 MB of fp32 states


def _rss_within_budgets(rank, world, tmp_path):
    """Runs in a fresh process: RSS growth is measured without what other tests left in the pytest process."""
    model = _mlp()  # the caller's full model exists before initialize (no zero.Init): not counted
    gc.collect()
    proc = psutil.Process(os.getpid())
    base = proc.memory_info().rss
    params = sum(p.numel() for p in model.parameters())
    host, device = 96 << 20, 72 << 20  # grads (4 B/param) + staging on the host; param shards on the device
    cfg = {"train_batch_size": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "allgather_bucket_size": 1 << 20, "sub_group_size": 1 << 19,
                                 "stage3_param_persistence_threshold": 2048,
                                 "stage3_prefetch_bucket_size": 1 << 20, "stage3_max_live_parameters": 3 << 20,
                                 "offload_optimizer": {"device": "cpu", "nvme_path": str(tmp_path)},
                                 "memory_budget": {"host": host, "device": device}}}
    engine = zero_cache.initialize(model=model, config=cfg)
    x = torch.randn(4, 1024)
    peak = proc.memory_info().rss
    losses = []
    for _ in range(3):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        peak = max(peak, proc.memory_info().rss)
    rep = engine.memory_report()
    for tier, budget in rep.budget.items():
        assert rep.peak_by_tier.get(tier, 0) <= budget
    assert rep.by_kind_tier[("optimizer", "nvme")] >= 0.5 * 8 * params  # most Adam states live on SSD
    assert losses[-1] < losses[0]
    grown = peak - base
    assert rep.gathered_peak <= 4 * params / 2  # transient gathered chunks: never the whole model
    assert grown <= host + device + rep.gathered_peak + RSS_OVERHEAD, f"RSS grew {grown / 2**20:.0f} MiB"
    assert 16 * params > host + device + RSS_OVERHEAD  # the states would not fit in that without the SSD
    engine.close()
    return True


@pytest.mark.multiprocess
def test_process_rss_stays_within_budgets(tmp_path):
    assert run_distributed(_rss_within_budgets, 1, tmp_path)[0]
