"""The storage-pointer mechanisms behind the gathered-parameter arena: torch's ``_swap_data_ptr_`` where it
exists, the native helper everywhere (forced here with ZERO_CACHE_STORAGE_POINTER=native, which is what
torch 2.11 and 2.12 use), and training without either (the arena is left out, with a warning)."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    make_engine,
    reference_run,
    to_numpy,
    train_engine,
)
from zero_cache import storage_pointer
from zero_cache.param_arena import region_numel

STEPS = 3


@pytest.fixture
def native(monkeypatch, tmp_path):
    monkeypatch.setenv("ZERO_CACHE_STORAGE_POINTER", "native")
    monkeypatch.setenv("ZERO_CACHE_BUILD_DIR", str(tmp_path / "build"))
    storage_pointer._build.cache_clear()
    yield
    storage_pointer._build.cache_clear()


@pytest.fixture
def unavailable(monkeypatch):
    monkeypatch.setenv("ZERO_CACHE_STORAGE_POINTER", "native")
    monkeypatch.setattr(storage_pointer, "_build", lambda: (None, "no C++ compiler found (set CXX, or install g++)"))


def test_native_helper_moves_the_memory_under_every_view(native, tmp_path):
    assert storage_pointer.mechanism() == storage_pointer.NATIVE
    assert len(list((tmp_path / "build").glob("storage_pointer-*.so"))) == 1  # built once, renamed into place
    full = torch.zeros(8)
    view = full[2:6].view(2, 2)
    transposed = view.t()  # a view of a view, as autograd saves weight.t()
    buffer = torch.arange(100.0)
    storage = full.untyped_storage()
    storage_pointer.point(storage, buffer.data_ptr() + 10 * 4, 8 * 4, full.device)
    assert storage.nbytes() == 32 and storage.data_ptr() == buffer.data_ptr() + 40
    assert torch.equal(transposed, torch.tensor([[12.0, 14.0], [13.0, 15.0]]))
    full.fill_(-1.0)  # writes land in the buffer, which still owns the memory
    assert torch.equal(buffer[10:18], torch.full((8,), -1.0)) and buffer[9] == 9.0
    storage_pointer.point(storage, 0, 0, full.device)
    assert storage.nbytes() == 0
    storage.resize_(32)  # an emptied storage allocates again as a released chunk's does
    assert full.untyped_storage().nbytes() == 32


def test_without_a_mechanism_point_is_one_clear_error(unavailable):
    assert storage_pointer.mechanism() is None
    with pytest.raises(storage_pointer.StoragePointerError,
                       match=r"torch .* has no UntypedStorage._swap_data_ptr_ \(torch 2.13\+\) and the native helper "
                             r"could not be built: no C\+\+ compiler found"):
        storage_pointer.point(torch.zeros(4).untyped_storage(), 0, 0, torch.device("cpu"))


def _train(rank, world_size, arena, force):
    import os

    if force:
        os.environ["ZERO_CACHE_STORAGE_POINTER"] = "native"
    engine = make_engine(ds_config(3, world_size, max_contigous_params_size=arena), activation_checkpointing=True)
    losses = train_engine(engine, batches(STEPS), rank, world_size)
    out = {"losses": losses, "weights": to_numpy(engine.gather_state_dict()),
           "arena": engine.coordinator.arena is not None, "mechanism": storage_pointer.mechanism()}
    engine.close()
    return out


@pytest.mark.multiprocess
def test_arena_on_the_native_helper_trains_like_reference(monkeypatch, tmp_path):
    """Two chunks' worth of arena (evictions every step) with recomputation, on the helper torch 2.11 uses."""
    monkeypatch.setenv("ZERO_CACHE_BUILD_DIR", str(tmp_path / "build"))
    ref_losses, ref_weights = reference_run(STEPS, activation_checkpointing=True)
    per_rank = run_distributed(_train, 2, 2 * region_numel(1100, 4), True, timeout=180)
    assert all(r["arena"] and r["mechanism"] == storage_pointer.NATIVE for r in per_rank)
    losses = [sum(r["losses"][s] for r in per_rank) / 2 for s in range(STEPS)]
    assert_close_losses(losses, ref_losses)
    assert_close_weights(per_rank[0]["weights"], ref_weights[-1])


def test_without_a_mechanism_the_arena_is_left_out_with_a_warning(unavailable, caplog):
    ref_losses, ref_weights = reference_run(STEPS, activation_checkpointing=True)
    with caplog.at_level(logging.WARNING, logger="zero_cache.coordinator"):
        out = _train(0, 1, 2 * region_numel(1100, 4), False)
    assert not out["arena"]
    (warning,) = [r.getMessage() for r in caplog.records if "max_contigous_params_size" in r.getMessage()]
    assert "gathered chunks get allocations of their own" in warning and "no C++ compiler found" in warning
    assert_close_losses(out["losses"], ref_losses)
    assert_close_weights(out["weights"], ref_weights[-1])
