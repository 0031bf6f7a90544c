"""Checkpoints on a full disk (a small tmpfs; needs root, as CI runs): one clear error, no partial files."""
from __future__ import annotations

import os

import pytest
import torch

import zero_cache
from megatron.training.checkpoint.legacy import write_atomic
from tests.tmpfs import mounted_tmpfs
from tests.zero_cache.common import batches, ds_config, make_model, train_engine
from zero_cache.checkpoint import CheckpointError, disk_space
from zero_cache.checkpoint.slices import atomic_torch_save


@pytest.fixture
def small_disk(tmp_path):
    """A 32 KiB filesystem: half the test engine's states (64 KiB)."""
    with mounted_tmpfs(tmp_path / "small", "32k") as path:
        yield path


def _trained_engine():
    model = make_model()
    engine = zero_cache.initialize(model=model, config=ds_config(3, 1))
    engine.register_external_parameter(model.head, model.embed.weight)
    train_engine(engine, batches(), 0, 1, steps=range(1))
    return engine


def test_save_that_cannot_fit_is_refused_before_writing(small_disk):
    engine = _trained_engine()
    with pytest.raises(CheckpointError, match=r"no space left on the filesystem of .*small/ckpt/global_step1: "
                                              r"\d+ bytes needed, \d+ bytes free; nothing was written; free space "
                                              r"there or save elsewhere \(--save\)"):
        engine.save_checkpoint(str(small_disk / "ckpt"))
    assert [f for _, _, files in os.walk(small_disk) for f in files] == []


def test_write_that_runs_out_of_space_removes_its_files(small_disk, monkeypatch):
    engine = _trained_engine()
    monkeypatch.setattr(disk_space, "check_free", lambda path, needed: None)  # as if another writer filled it
    with pytest.raises(CheckpointError, match=r"no space left on the filesystem of .*small/ckpt/global_step1: "
                                              r"\d+ bytes free; the partial files were removed"):
        engine.save_checkpoint(str(small_disk / "ckpt"))
    assert [f for _, _, files in os.walk(small_disk) for f in files] == []
    assert disk_space.free_bytes(str(small_disk)) == 32 << 10


@pytest.mark.parametrize("save", [write_atomic, atomic_torch_save], ids=["megatron-layout", "zero-layout"])
def test_torch_save_onto_a_full_disk_is_one_error_without_temporary_files(small_disk, save):
    path = small_disk / "iter_0000001" / "model_optim_rng.pt"
    path.parent.mkdir()
    with pytest.raises(CheckpointError, match=r"no space left on the filesystem of .*model_optim_rng.pt: \d+ bytes "
                                              r"free; the partial files were removed"):
        save({"weight": torch.zeros(100_000)}, str(path))  # 400 KB
    assert os.listdir(path.parent) == []
