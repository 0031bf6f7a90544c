"""Sliced checkpoints (``save_large_model_multi_slice``): every rank streams its shards from their tier into
bounded slice files and back, so save and load hold a few slices of host memory whatever the model size.

The DP=2 run keeps parameters and optimizer states on SSD under a host budget that the rank's states exceed
several times; save -> train and load -> train give identical losses and weights, the save/load buffers
stay within the stated bound, and consolidation reproduces ``gather_state_dict`` bit for bit. Damaged,
missing or truncated slices are errors naming the file; a crash mid-save leaves the previous tag loadable.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.memory_utils import PeakRSS
from tests.zero_cache.ssd_common import BLOCK, HOST_BUDGET, SLICE, ssd_data, ssd_engine, ssd_train
from zero_cache import aio
from zero_cache.checkpoint import CheckpointError
from zero_cache.checkpoint import slices as slices_module
from zero_cache.checkpoint.consolidate import consolidate, load_consolidated
from zero_cache.config import AioConfig, ZeroConfigError, parse_config
from zero_cache.ssd_store import SSDStore
from zero_cache.store import DeviceHostStore

DP = 2


def _numpy(sd: dict) -> dict:
    return {k: v.numpy() for k, v in sd.items()}


# ---- DP=2, states on SSD beyond the host budget ----------------------------------------------------------
def _save_run(rank, world_size, nvme, ckpt):
    engine = ssd_engine(nvme, seed=0)
    data = ssd_data(6)
    first = ssd_train(engine, data, rank, world_size, range(3))
    report = engine.memory_report()
    engine.save_sharded_checkpoint(ckpt + "-first", client_state={"iteration": 3})  # one-time costs stay out
    with PeakRSS() as rss:
        engine.save_sharded_checkpoint(ckpt, client_state={"iteration": 3})
    pool = engine.store.transfer_pool
    out = {"first": first, "state_bytes": report.total, "host_peak": report.peak_by_tier["host"],
           "nvme_bytes": report.by_tier.get("nvme", 0), "save_pool_peak": pool.peak_held,
           "pool_after": pool.held, "save_rss": rss.growth, "shards": sum(c.plan.shard for c in engine.chunks)}
    out["at_save"] = _numpy(engine.gather_state_dict())
    out["rest"] = ssd_train(engine, data, rank, world_size, range(3, 6))
    out["final"] = _numpy(engine.gather_state_dict())
    engine.close()
    return out


def _resume_run(rank, world_size, nvme, ckpt):
    engine = ssd_engine(nvme, seed=1)  # another init: the load must overwrite every state
    engine.load_checkpoint(ckpt)  # one-time costs of a first load stay out of the measured one
    with PeakRSS() as rss:
        path, client = engine.load_checkpoint(ckpt)
    out = {"tag": os.path.basename(path), "client": client, "steps": engine.global_steps,
           "load_pool_peak": engine.store.transfer_pool.peak_held, "load_rss": rss.growth}
    out["rest"] = ssd_train(engine, ssd_data(6), rank, world_size, range(3, 6))
    out["final"] = _numpy(engine.gather_state_dict())
    engine.close()
    return out


@pytest.mark.multiprocess
def test_sliced_save_and_resume_beyond_the_host_budget_is_exact(tmp_path):
    nvme, ckpt = str(tmp_path / "nvme"), str(tmp_path / "ckpt")
    saved = run_distributed(_save_run, DP, nvme, ckpt, timeout=240)
    resumed = run_distributed(_resume_run, DP, nvme, ckpt, timeout=240)
    slice_bytes = aio.round_up(4 * SLICE)
    for r in range(DP):
        s, res = saved[r], resumed[r]
        # The rank's states are several times the host budget; what it keeps on the host fits the budget.
        assert s["state_bytes"] > 2.5 * HOST_BUDGET and s["nvme_bytes"] > 1.5 * HOST_BUDGET
        assert s["host_peak"] <= HOST_BUDGET
        # Exact resume.
        assert (res["tag"], res["client"], res["steps"]) == ("global_step3", {"iteration": 3}, 3)
        assert res["rest"] == s["rest"], f"rank {r}: resumed losses differ"
        # Bounded memory: save holds one slice per optimizer state plus one SSD block; load one SSD block
        # (slice files are memory-mapped). The pool gives everything back afterwards.
        assert s["save_pool_peak"] <= 2 * slice_bytes + aio.round_up(BLOCK), s["save_pool_peak"]
        assert res["load_pool_peak"] <= aio.round_up(BLOCK), res["load_pool_peak"]
        assert s["save_pool_peak"] < s["state_bytes"] / 20 and s["pool_after"] == 0
        # Resident memory (pool, mapped slices, interpreter overhead) grew by under a sixth of the rank's state
        # bytes; holding one kind's states whole, as the unsliced layout does, grows it by 2-3x a state stream.
        assert max(s["save_rss"], res["load_rss"]) < s["state_bytes"] / 6, (s["save_rss"], res["load_rss"])
        print(f"rank {r}: states {s['state_bytes']} B ({s['nvme_bytes']} on SSD), host budget {HOST_BUDGET}; "
              f"save pool peak {s['save_pool_peak']} B, RSS +{s['save_rss']} B; load pool peak "
              f"{res['load_pool_peak']} B, RSS +{res['load_rss']} B")
    for k, v in saved[0]["final"].items():
        assert torch.equal(torch.as_tensor(resumed[0]["final"][k]), torch.as_tensor(v)), k

    tag_dir = os.path.join(ckpt, "global_step3")
    n = math.ceil(saved[0]["shards"] / SLICE)
    expected = {f"zero_pp_rank_{r}_mp_rank_00_{kind}_states{suffix}.pt" for r in range(DP)
                for kind in ("model", "optim") for suffix in ["", *(f".slice{k:05d}" for k in range(n))]}
    sidecars = {f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt.crc32" for r in range(DP) for kind in ("model", "optim")}
    assert set(os.listdir(tag_dir)) == expected | sidecars and n >= 8  # each metadata file's checksum beside it
    for name in sorted(expected):  # every file is plain tensors and values; slice files stay within their bound
        obj = torch.load(os.path.join(tag_dir, name), weights_only=True)
        if ".slice" in name:
            states = [k for k in obj if k != "offset"]
            assert os.path.getsize(os.path.join(tag_dir, name)) <= len(states) * 4 * SLICE + 4096
            assert all(obj[k].numel() <= SLICE for k in states)

    out = str(tmp_path / "fp32")
    consolidate(ckpt, out)
    merged = load_consolidated(out)
    assert merged.keys() == saved[0]["at_save"].keys()
    for k, v in saved[0]["at_save"].items():
        assert torch.equal(merged[k], torch.as_tensor(v)), k


# ---- single process: damage, crash mid-save, the unsliced path ---------------------------------------------
def _saved(tmp_path, **zero):
    """A one-rank engine trained 2 steps and saved under global_step2; returns (engine, ckpt, weights)."""
    engine = ssd_engine(str(tmp_path / "nvme"), seed=0, depth=4, **zero)
    ssd_train(engine, ssd_data(3), 0, 1, range(2))
    ckpt = str(tmp_path / "ckpt")
    engine.save_sharded_checkpoint(ckpt)
    return engine, ckpt, engine.gather_state_dict()


def _flip_tensor_byte(path: str, key: str) -> None:
    """Flip one bit in the middle of tensor ``key``'s stored bytes (the file stays a valid archive)."""
    data = torch.load(path, weights_only=True)[key].numpy().tobytes()
    raw = open(path, "rb").read()
    at = raw.index(data) + len(data) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([raw[at] ^ 0x10]))


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_damaged_slice_is_a_clear_error_naming_the_file(tmp_path, damage):
    engine, ckpt, _ = _saved(tmp_path, save_large_model_slice_size=4096)
    engine.close()
    path = os.path.join(ckpt, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.slice00002.pt")
    if damage == "missing":
        os.remove(path)
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 1000)
    else:
        _flip_tensor_byte(path, "exp_avg_sq")
    fresh = ssd_engine(str(tmp_path / "nvme"), seed=1, depth=4)
    before = fresh.gather_state_dict()
    with pytest.raises(CheckpointError) as e:
        fresh.load_checkpoint(ckpt)
    assert path in str(e.value)
    assert {"missing": "is missing", "truncated": "is truncated",
            "flipped": "is corrupted: CRC-32 of 'exp_avg_sq'"}[damage] in str(e.value)
    if damage != "flipped":  # found before anything was loaded: the engine is untouched
        after = fresh.gather_state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
    fresh.close()


def test_consolidation_of_a_corrupted_slice_names_the_file(tmp_path):
    engine, ckpt, _ = _saved(tmp_path, save_large_model_slice_size=4096)
    engine.close()
    path = os.path.join(ckpt, "global_step2", "zero_pp_rank_0_mp_rank_00_model_states.slice00001.pt")
    _flip_tensor_byte(path, "master")
    with pytest.raises(CheckpointError, match="is corrupted: CRC-32 of 'master'") as e:
        consolidate(ckpt, str(tmp_path / "out"))
    assert path in str(e.value)


def test_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    engine, ckpt, at_step2 = _saved(tmp_path, save_large_model_slice_size=4096)
    ssd_train(engine, ssd_data(3), 0, 1, [2])
    real, written = slices_module.atomic_torch_save, []

    def failing(obj, path):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        written.append(path)
        real(obj, path)

    monkeypatch.setattr(slices_module, "atomic_torch_save", failing)
    with pytest.raises(OSError, match="No space left"):
        engine.save_sharded_checkpoint(ckpt)
    assert len(written) == 3 and engine.store.transfer_pool.held == 0  # buffers returned despite the failure
    engine.close()
    assert open(os.path.join(ckpt, "latest")).read() == "global_step2"
    fresh = ssd_engine(str(tmp_path / "nvme"), seed=1, depth=4)
    fresh.load_checkpoint(ckpt)
    got = fresh.gather_state_dict()
    assert all(torch.equal(got[k], v) for k, v in at_step2.items())
    fresh.close()


@pytest.mark.parametrize("multi_slice", [False, True])
def test_both_layouts_round_trip_and_consolidate(tmp_path, multi_slice):
    engine, ckpt, weights = _saved(tmp_path, save_large_model_multi_slice=multi_slice)
    n = math.ceil(sum(c.plan.shard for c in engine.chunks) / SLICE) if multi_slice else 0
    losses = ssd_train(engine, ssd_data(3), 0, 1, [2])
    engine.close()
    files = sorted(os.listdir(os.path.join(ckpt, "global_step2")))
    suffixes = ["", *(f".slice{k:05d}" for k in range(n))]
    assert files == sorted([f"zero_pp_rank_0_mp_rank_00_{k}_states{s}.pt" for k in ("model", "optim") for s in suffixes]
                           + [f"zero_pp_rank_0_mp_rank_00_{k}_states.pt.crc32" for k in ("model", "optim")])
    # The reader follows the files, not its own setting.
    _assert_reloads(tmp_path, ckpt, weights, losses, save_large_model_multi_slice=not multi_slice)


def _assert_reloads(tmp_path, ckpt, weights, losses, **zero):
    """A fresh engine (other init) loads ``ckpt``: same weights, same next step; consolidation equals too."""
    fresh = ssd_engine(str(tmp_path / "nvme"), seed=1, depth=4, **zero)
    fresh.load_checkpoint(ckpt)
    assert all(torch.equal(fresh.gather_state_dict()[k], v) for k, v in weights.items())
    assert ssd_train(fresh, ssd_data(3), 0, 1, [2]) == losses
    fresh.close()
    consolidate(ckpt, str(tmp_path / "out"))
    merged = load_consolidated(str(tmp_path / "out"))
    assert all(torch.equal(merged[k], v) for k, v in weights.items())


def test_checkpoints_of_the_previous_format_still_load(tmp_path):
    """zero_cache/1 (before slices) kept one tensor per chunk inside the metadata files."""
    engine, ckpt, weights = _saved(tmp_path, save_large_model_multi_slice=False)
    shards = [c.plan.shard for c in engine.chunks]
    losses = ssd_train(engine, ssd_data(3), 0, 1, [2])
    engine.close()
    for kind, names in (("model", ("master",)), ("optim", ("exp_avg", "exp_avg_sq"))):
        path = os.path.join(ckpt, "global_step2", f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt")
        meta = torch.load(path, weights_only=True)
        meta["format"] = "zero_cache/1"
        meta.update({n: [t.clone() for t in torch.split(meta[n], shards)] for n in names})
        torch.save(meta, path)
        os.remove(f"{path}.crc32")  # that format recorded no checksum beside its files
    _assert_reloads(tmp_path, ckpt, weights, losses)


# ---- range I/O of the stores -----------------------------------------------------------------------------
def test_ssd_range_io_is_exact_and_keeps_the_page_checksum(tmp_path):
    store = SSDStore(torch.device("cpu"), str(tmp_path), AioConfig(block_size=8192, queue_depth=2))
    store.allocate("c0.exp_avg", "optimizer", "nvme", 10_000, torch.float32)
    store.allocate("c0.param", "params", "nvme", 7_001, torch.bfloat16)
    v = torch.randn(10_000)
    at = 0
    for n in (3, 1021, 2048, 5000, 1928):  # unaligned pieces, one sequential pass: the header CRC is set
        store.write_range("c0.exp_avg", at, v[at:at + n])
        at += n
    assert torch.equal(store.read("c0.exp_avg"), v)  # a whole read verifies the CRC the pass wrote
    got, at = torch.empty(10_000), 0
    for n in (777, 4000, 5223):
        store.read_range("c0.exp_avg", at, at + n, out=got[at:at + n])
        at += n
    assert torch.equal(got, v)
    store.write_range("c0.exp_avg", 5, torch.ones(10))  # not a pass: the next whole read re-establishes the CRC
    v[5:15] = 1
    assert torch.equal(store.read("c0.exp_avg"), v) and torch.equal(store.read_range("c0.exp_avg", 3, 20), v[3:20])
    w = torch.randn(7_001)  # fp32 values into a bf16 page and back
    store.write_range("c0.param", 0, w[:3000])
    store.write_range("c0.param", 3000, w[3000:])
    assert torch.equal(store.read("c0.param"), w.bfloat16())
    assert torch.equal(store.read_range("c0.param", 10, 6000, out=torch.empty(5990)), w.bfloat16().float()[10:6000])
    assert store.transfer_pool.peak_held == 8192 and store.transfer_pool.in_use == 0  # one block, whatever the range
    with pytest.raises(IndexError, match=r"shard 'c0.exp_avg' holds 10000 elements; range \[9990, 10010\)"):
        store.write_range("c0.exp_avg", 9990, torch.ones(20))
    path = os.path.join(store.directory, "c0.exp_avg.swp")
    with open(path, "r+b") as f:  # corrupt one byte: a read pass over the whole shard reports the file
        f.seek(aio.HEADER_BYTES + 9000)
        byte = f.read(1)
        f.seek(aio.HEADER_BYTES + 9000)
        f.write(bytes([byte[0] ^ 1]))
    store.read_range("c0.exp_avg", 0, 5000)
    with pytest.raises(aio.SSDTierError, match="is corrupted: payload checksum") as e:
        store.read_range("c0.exp_avg", 5000, 10_000)
    assert path in str(e.value) and store.transfer_pool.in_use == 0
    store.close()


def test_memory_store_range_io():
    store = DeviceHostStore(torch.device("cpu"))
    t = store.allocate("c0.master", "optimizer", "host", 100, torch.float32)
    store.write_range("c0.master", 40, torch.arange(10.0))
    assert torch.equal(t[40:50], torch.arange(10.0)) and t[:40].abs().sum() == 0 and t[50:].abs().sum() == 0
    copy = store.read_range("c0.master", 38, 52)
    assert torch.equal(copy, t[38:52]) and copy.data_ptr() != t[38:52].data_ptr()
    with pytest.raises(IndexError, match=r"range \[95, 105\) is outside it"):
        store.write_range("c0.master", 95, torch.ones(10))


def test_slice_size_is_validated():
    with pytest.raises(ZeroConfigError, match="'zero_optimization.save_large_model_slice_size' must be >= 1024"):
        parse_config({"zero_optimization": {"save_large_model_slice_size": 100}})
