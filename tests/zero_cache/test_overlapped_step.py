"""Overlapped step (``zero_optimization.overlap_optimizer_step``): with sub-groups on SSD the step returns while
its update still runs, the next forward's gather of each chunk waits for that chunk's update, and the result
is bit-identical to waiting for the whole update in the step."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import zero_cache
from tests.zero_cache.common import batches, ds_config, make_model, train_engine
from zero_cache import aio
from zero_cache.aio import SSDTierError

STEPS = 3


def _engine(nvme: str, overlap: bool, offload_param: str):
    zero = {"sub_group_size": 600, "prefetch_cache_sub_group_rate": 0.0, "overlap_optimizer_step": overlap,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param, "nvme_path": nvme}
    model = make_model()
    engine = zero_cache.initialize(model=model, config=ds_config(3, 1, **zero))
    engine.register_external_parameter(model.head, model.embed.weight)
    return engine


def _hold_last_sub_group(engine) -> tuple[threading.Event, list[int]]:
    """Hold the background update just before it writes the last sub-group's states back (so that sub-group is
    updated in memory but not yet handed to the store): it goes on when ``release`` is set, which the forward's
    gate does when it waits for one of those chunks, or after 120 s (a guard against a hang)."""
    last = engine.sub_groups[-1]
    keys = {engine.chunks[i].key(n) for i in last for n in engine.chunks[i].swapped}
    release = threading.Event()
    swap_out = engine.store.swap_out

    def held(ks, tensors, keep=()):
        if threading.current_thread().name.startswith("zero_cache_step") and keys & set(ks):
            release.wait(120.0)
        return swap_out(ks, tensors, keep)

    wait_updated = engine.update.before_gather

    def gate(chunk):
        if chunk in last and not engine.update.may_gather(chunk):  # about to wait for the held update
            release.set()
        wait_updated(chunk)

    engine.store.swap_out = held
    engine.update.before_gather = gate
    return release, last


@pytest.mark.parametrize("offload_param", ["none", "nvme"])
def test_forward_waits_for_each_chunk_update_and_matches_the_waiting_step(tmp_path, offload_param):
    data = batches(STEPS)
    waiting = _engine(str(tmp_path / "a"), False, offload_param)
    ref_losses = train_engine(waiting, data, 0, 1)
    assert not waiting.update.in_flight()  # without the overlap the step returns with its update done
    ref_weights = waiting.gather_state_dict()
    waiting.close()

    engine = _engine(str(tmp_path / "b"), True, offload_param)
    release, last = _hold_last_sub_group(engine)
    losses = train_engine(engine, data, 0, 1, steps=[0])
    # The step has returned while its update is still running, held before the last sub-group's write-back.
    assert engine.update.in_flight()
    assert not any(engine.update.may_gather(c) for c in last)
    assert not release.is_set()
    losses += train_engine(engine, data, 0, 1, steps=range(1, STEPS))
    # The next forward reached the held chunks and waited for them (it released the hold itself, not the
    # fallback): a forward that read them before their update would have given other losses.
    assert release.is_set()
    assert losses == ref_losses
    weights = engine.gather_state_dict()
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name
    engine.close()


def test_an_update_that_fails_under_the_forward_raises_there(tmp_path):
    engine = _engine(str(tmp_path), True, "none")
    data = batches(3)
    train_engine(engine, data, 0, 1, steps=[0])
    engine.synchronize_writes()  # damage the file after the step's write-back, not under it
    victim = os.path.join(engine.store.directory, f"c{engine.sub_groups[-1][-1]}.exp_avg.swp")
    with open(victim, "r+b") as f:
        f.seek(aio.HEADER_BYTES)
        f.write(b"\xff" * 16)
    train_engine(engine, data, 0, 1, steps=[1])  # returns: its update reads the damaged file in the background
    with pytest.raises(SSDTierError, match=f"'{victim}' is corrupted"):
        train_engine(engine, data, 0, 1, steps=[2])  # the forward's gather of that chunk
    assert not engine.update.in_flight()
    assert engine.store.pool.in_use == 0  # no staging buffer is left in use or targeted by I/O
    engine.close()  # the error was raised once; closing does not raise it again
