"""The distributed checkpoint: saved by one ZeRO layout, resumed by others, exactly; bounded memory; damage.

Resharding: ZeRO-3 on 2 ranks with every state on SSD saves at step 5; ZeRO-1 on 1 rank (host optimizer,
other page and sub-group sizes), ZeRO-3 on 4 ranks (states on the device) and ZeRO-2 on 2 ranks (optimizer on
SSD) load it: steps 6-10 and the final weights equal the uninterrupted single-process reference (fp32, 1e-5).
"""
from __future__ import annotations

import os

import pytest
import torch

import zero_cache
from tests.dist_utils import run_distributed
from tests.memory_utils import PeakRSS
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
from tests.zero_cache.ssd_common import HOST_BUDGET, SLICE, ssd_data, ssd_engine, ssd_train
from zero_cache.checkpoint import CheckpointError, distributed, integrity


def _engine(config: dict, seed: int = 0):
    model = make_model(seed=seed)
    engine = zero_cache.initialize(model=model, config=config)
    engine.register_external_parameter(model.head, model.embed.weight)
    return engine


def _nvme(stage: int, dp: int, path: str, **zero) -> dict:
    device = {"device": "nvme", "nvme_path": path}
    extra = {"offload_param": dict(device)} if stage == 3 else {}
    return ds_config(stage, dp, offload_optimizer=dict(device), **extra, **zero)


def _save(rank, world, ckpt, nvme):
    engine = _engine(_nvme(3, world, nvme))
    losses = train_engine(engine, batches(), rank, world, steps=range(5))
    engine.save_checkpoint(ckpt, client_state={"iteration": 5})
    engine.close()
    return losses


def _resume(rank, world, ckpt, config):
    engine = _engine(config, seed=123)  # another init: the load must overwrite every state
    path, client = engine.load_checkpoint(ckpt)
    assert client == {"iteration": 5} and engine.global_steps == 5 and path.endswith("global_step5")
    losses = train_engine(engine, batches(), rank, world, steps=range(5, 10))
    weights = to_numpy(engine.gather_state_dict())
    engine.close()
    return losses, weights


def _mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """The global batch's loss: equal micro-batches, so the mean of the ranks' means."""
    return [sum(step) / len(step) for step in zip(*per_rank)]


@pytest.mark.multiprocess
def test_resharded_resume_matches_the_uninterrupted_run(tmp_path):
    ref_losses, ref_weights = reference_run()
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(_save, 2, ckpt, str(tmp_path / "nvme_save"), timeout=180)
    assert_close_losses(_mean_over_ranks(first), ref_losses[:5])
    targets = {
        "zero1-dp1-host": (1, ds_config(1, 1, offload=True, allgather_bucket_size=700, sub_group_size=2000)),
        "zero3-dp4-device": (4, ds_config(3, 4, allgather_bucket_size=1500, sub_group_size=500,
                                          stage3_param_persistence_threshold=10)),
        "zero2-dp2-nvme": (2, _nvme(2, 2, str(tmp_path / "nvme_load"), sub_group_size=1000)),
    }
    for name, (world, config) in targets.items():
        outs = run_distributed(_resume, world, ckpt, config, timeout=180)
        assert_close_losses(_mean_over_ranks([o[0] for o in outs]), ref_losses[5:])
        assert_close_weights(outs[0][1], ref_weights[-1])
        print(f"{name}: steps 6-10 and final weights equal the reference")


# ---- memory: states several times the host budget, on SSD ---------------------------------------------------
def _bounded(rank, world, nvme, ckpt):
    engine = ssd_engine(nvme, seed=0)
    data = ssd_data(4)
    ssd_train(engine, data, rank, world, range(2))
    report = engine.memory_report()
    engine.save_checkpoint(ckpt + "-first")  # one-time costs of a first save (thread pools, caches) stay out
    with PeakRSS() as save_rss:
        engine.save_checkpoint(ckpt)
    rest = ssd_train(engine, data, rank, world, range(2, 4))
    engine.close()
    fresh = ssd_engine(nvme, seed=1)
    with PeakRSS() as load_rss:
        fresh.load_checkpoint(ckpt)
    again = ssd_train(fresh, data, rank, world, range(2, 4))
    fresh.close()
    return {"states": report.total, "nvme": report.by_tier.get("nvme", 0), "save": save_rss.growth,
            "load": load_rss.growth, "rest": rest, "again": again}


@pytest.mark.multiprocess
def test_save_and_load_beyond_the_host_budget_stay_within_the_slice_bound(tmp_path):
    outs = run_distributed(_bounded, 2, str(tmp_path / "nvme"), str(tmp_path / "ckpt"), timeout=300)
    slice_bytes = 4 * SLICE
    for o in outs:
        assert o["states"] > 2.5 * HOST_BUDGET and o["nvme"] > 1.5 * HOST_BUDGET
        assert o["again"] == o["rest"]  # exact resume from states that never fit in memory
        # One stored chunk (at most a slice) in flight, read from SSD or from the file, and its serialized
        # copy, plus the planner's metadata and the allocator's slack: a fraction of the states.
        bound = 4 * slice_bytes + (2 << 20)
        assert o["save"] < bound and o["load"] < bound, (o["save"], o["load"], bound)
        assert bound < o["states"] / 3
        print(f"states {o['states']} B ({o['nvme']} on SSD), host budget {HOST_BUDGET}: RSS +{o['save']} B "
              f"saving, +{o['load']} B loading (slice {slice_bytes} B)")


# ---- damage, in one process --------------------------------------------------------------------------------
def _saved_single(tmp_path):
    engine = _engine(ds_config(3, 1))
    train_engine(engine, batches(), 0, 1, steps=range(2))
    path = engine.save_checkpoint(str(tmp_path / "ckpt"))
    return engine, path


def _data_file(path: str) -> str:
    return os.path.join(path, next(f for f in sorted(os.listdir(path)) if f.endswith(".distcp")))


def _flip(path: str, at: float = 0.5) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[int(len(raw) * at)] ^= 0x10
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing", "metadata", "no-checksums"])
def test_damaged_checkpoint_is_one_error_naming_the_file(tmp_path, damage):
    engine, path = _saved_single(tmp_path)
    before = to_numpy(engine.gather_state_dict())
    data = _data_file(path)
    if damage == "flipped":
        _flip(data)
    elif damage == "truncated":
        os.truncate(data, os.path.getsize(data) - 100)
    elif damage == "missing":
        os.remove(data)
    elif damage == "metadata":
        _flip(os.path.join(path, distributed.METADATA), 0.9)
    else:
        os.remove(os.path.join(path, integrity.CHECKSUMS))
    with pytest.raises(CheckpointError) as e:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    message = str(e.value)
    assert "\n" not in message and "load an earlier iteration" in message, message
    named = {"flipped": data, "truncated": data, "missing": data,
             "metadata": os.path.join(path, distributed.METADATA),
             "no-checksums": os.path.join(path, integrity.CHECKSUMS)}[damage]
    assert named in message, message
    expect = {"flipped": "corrupted", "truncated": "truncated", "missing": "missing", "metadata": "corrupted",
              "no-checksums": "incomplete"}[damage]
    assert expect in message, message
    # Verified before anything was read: the engine's states are untouched.
    after = to_numpy(engine.gather_state_dict())
    assert all((after[k] == v).all() for k, v in before.items())


def test_another_model_is_one_error_naming_both_shapes(tmp_path):
    _, path = _saved_single(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine = zero_cache.initialize(model=other, config=ds_config(3, 1))
    with pytest.raises(CheckpointError, match="does not match this model"):
        engine.load_checkpoint(str(tmp_path / "ckpt"))
