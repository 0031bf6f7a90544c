"""The update strategies (zero_cache/update/), each chosen from the config alone and each run against the
waiting step: the overlapped and the speculative updates are bit-identical to it, the delayed one is the
one-step-stale schedule of the lock-free reference. Single process: the strategies, not the collectives."""
from __future__ import annotations

import pytest
import torch

from tests.zero_cache.common import batches, ds_config, make_engine, rank_micro_batches
from tests.zero_cache.test_lock_free import delayed_reference
from zero_cache.update import DelayedUpdate, OverlappedUpdate, SpeculativeUpdate, WaitingUpdate

STEPS = 4
EMULATED = {"enabled": True, "h2d_gbps": 0.5, "d2h_gbps": 0.5}


def _config(mode: str, nvme: str) -> dict:
    ssd = {"device": "nvme", "nvme_path": nvme}
    host = {"device": "cpu", "pin_memory": True}
    zero = {"waiting": {"offload_optimizer": ssd, "offload_param": ssd, "overlap_optimizer_step": False},
            "overlapped": {"offload_optimizer": ssd, "offload_param": ssd},
            "delayed": {"offload_optimizer": {"device": "cpu"}, "lock_free_update": True},
            "waiting-emulated": {"offload_optimizer": host, "offload_param": host, "emulated_accelerator": EMULATED,
                                 "overlap_optimizer_step": False},
            "speculative": {"offload_optimizer": host, "offload_param": host, "emulated_accelerator": EMULATED,
                            "speculative_update": True}}[mode]
    return ds_config(3, 1, **zero)


def _train(mode: str, nvme: str):
    engine = make_engine(_config(mode, nvme))
    data, losses, kinds, acted = batches(STEPS), [], type(engine.update), 0
    for s in range(STEPS):
        micro = []
        for mb in rank_micro_batches(data[s], 0, 1):
            loss = engine(mb)
            micro.append(loss.item())
            engine.backward(loss)
        engine.step()
        # What the strategy did beyond the waiting step: an update left running, sub-groups speculated.
        acted += engine.update.in_flight() + (engine.last_speculation.speculated if engine.last_speculation else 0)
        losses.append(sum(micro) / len(micro))
    weights = engine.gather_state_dict()
    engine.close()
    return kinds, losses, weights, acted


@pytest.mark.parametrize("mode, reference, strategy", [
    ("overlapped", "waiting", OverlappedUpdate),
    ("speculative", "waiting-emulated", SpeculativeUpdate),
])
def test_strategy_is_bit_identical_to_the_waiting_step(tmp_path, mode, reference, strategy):
    ref_kind, ref_losses, ref_weights, ref_acted = _train(reference, str(tmp_path / "a"))
    kind, losses, weights, acted = _train(mode, str(tmp_path / "b"))
    assert (ref_kind, kind) == (WaitingUpdate, strategy)
    assert ref_acted == 0 and acted > 0
    assert losses == ref_losses
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name


def test_delayed_strategy_is_the_one_step_stale_schedule(tmp_path):
    kind, losses, weights, _ = _train("delayed", str(tmp_path))
    assert kind is DelayedUpdate
    ref_losses, ref_weights = delayed_reference(STEPS)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, atol=1e-5, rtol=1e-5)
