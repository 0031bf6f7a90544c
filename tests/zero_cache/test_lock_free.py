"""Lock-free (delayed) update: step t's optimizer update runs in the background while step t+1 computes with
one-step-stale parameters. DP=2 per-step losses and final weights equal a single-process fp32 reference of
exactly that schedule (AdamW on the masters every step; the model sees the masters one step late)."""
from __future__ import annotations

import copy

import pytest
import torch

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    BETAS,
    CLIP,
    EPS,
    LR,
    STEPS,
    WD,
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    make_model,
    reference_run,
    to_numpy,
    train_engine,
)
from zero_cache.config import ZeroConfigError, parse_config

DP = 2


def delayed_reference(steps: int = STEPS):
    """Masters follow plain AdamW on g_1, g_2, ...; the forward of step t+1 uses the masters after update t-1."""
    model = make_model()
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = batches(steps)
    losses = []
    for s in range(steps):
        loss = model(data[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with torch.no_grad():  # publish update s-1, then run update s on the masters
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
                m.grad = p.grad.clone()
                p.grad = None
        opt.step()
        losses.append(loss.item())
    final = copy.deepcopy(model)
    with torch.no_grad():
        for p, m in zip(final.parameters(), masters):
            p.copy_(m)
    return losses, {k: v.detach().clone() for k, v in final.state_dict().items()}


def _run(rank, world_size, nvme):
    out = {}
    for device in ("cpu", "nvme"):
        model = make_model()
        cfg = ds_config(3, world_size, sub_group_size=600, lock_free_update=True,
                        offload_optimizer={"device": device, "nvme_path": nvme})
        engine = zero_cache.initialize(model=model, config=cfg)
        engine.register_external_parameter(model.head, model.embed.weight)
        first = dict(make_model().named_parameters())  # the initial values (same seed)
        losses = train_engine(engine, batches(), rank, world_size, steps=[0])
        # After the first step() returns, the update runs in the background: the model still holds step 0's
        # parameters (published at the next step).
        engine.coordinator.fetch(list(range(len(engine.chunks))))
        unchanged = all(torch.equal(p, first[n]) for n, p in model.named_parameters())
        engine.coordinator.end_step()
        losses += train_engine(engine, batches(), rank, world_size, steps=range(1, STEPS))
        out[device] = {"losses": losses, "weights": to_numpy(engine.gather_state_dict()),
                       "unchanged": unchanged, "report": engine.memory_report()}
        engine.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_run, DP, str(tmp_path_factory.mktemp("nvme")), timeout=240)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_lock_free_update_matches_delayed_reference_and_trains(results, device):
    ref_losses, ref_weights = delayed_reference()
    sync_losses, _ = reference_run()
    losses = [sum(r[device]["losses"][s] for r in results) / DP for s in range(STEPS)]
    assert_close_losses(losses, ref_losses)
    assert_close_weights(results[0][device]["weights"], ref_weights)
    assert losses[-1] < losses[0] - 0.05  # it still trains
    assert losses[0] == pytest.approx(sync_losses[0], rel=1e-5)
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses[1:], sync_losses[1:]))  # one-step-stale parameters
    for r in results:
        assert r[device]["unchanged"]
        rep = r[device]["report"]
        for tier, budget in rep.budget.items():
            assert rep.peak_by_tier.get(tier, 0) <= budget


def test_lock_free_update_needs_an_offloaded_optimizer():
    with pytest.raises(ZeroConfigError, match="'zero_optimization.lock_free_update' overlaps the offloaded optimizer"):
        parse_config({"zero_optimization": {"lock_free_update": True}})
