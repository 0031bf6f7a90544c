"""Pinned host memory is mapped once and pinned in place (zero_cache/pinned_memory.py): host-tier shards are
carved from one arena sized by the placement, SSD staging buffers and copy staging buffers are pinned
mappings, and nothing is pinned by copying a tensor. On a GPU the pinning is cudaHostRegister
(tests/cuda); here the emulated accelerator records it, and its copies read only pinned memory directly."""
from __future__ import annotations

import gc

import pytest
import torch

from tests.zero_cache.common import batches, ds_config, make_engine, train_engine
from zero_cache.aio import AlignedBuffer
from zero_cache.pinned_memory import ALIGN_BYTES, CudaPinning, HostArena
from zero_cache.states import State
from zero_cache.store import HOST

EMULATOR = {"enabled": True, "h2d_gbps": 1.0, "d2h_gbps": 1.0}


class RecordingPinning:
    def __init__(self):
        self.live: dict[int, int] = {}  # ptr -> bytes pinned now
        self.calls: list[tuple[str, int, int]] = []

    def register(self, ptr, nbytes):
        self.live[ptr] = nbytes
        self.calls.append(("register", ptr, nbytes))
        return True

    def unregister(self, ptr):
        self.calls.append(("unregister", ptr, self.live.pop(ptr)))

    def is_pinned(self, t):
        return t.untyped_storage().data_ptr() in self.live


def test_arena_carves_aligned_zeroed_shards_from_one_pinned_mapping():
    pinning = RecordingPinning()
    sizes = [(1000, torch.float32), (333, torch.bfloat16), (1, torch.float32), (5000, torch.float32)]
    reserve = HostArena.reserve_for([n * d.itemsize for n, d in sizes])
    assert reserve == 4096 + 768 + 256 + 20224  # each shard rounded up to the alignment
    arena = HostArena(pinning, reserve)
    shards = [arena.carve(n, d) for n, d in sizes]
    assert len(pinning.live) == 1 and arena.held == 28672  # one mapping: the reserve in whole pages
    (base,) = pinning.live
    for t, (n, d) in zip(shards, sizes):
        assert t.numel() == n and t.dtype == d and pinning.is_pinned(t) and not t.any()
        assert (t.data_ptr() - base) % ALIGN_BYTES == 0
    ends = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in shards)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # no overlap
    extra = arena.carve(10_000, torch.float32)  # beyond the reserve: a mapping of its own, pinned too
    assert len(pinning.live) == 2 and pinning.is_pinned(extra)


def test_a_mapping_is_unpinned_after_its_last_view_and_pinned_again_where_it_moves():
    pinning = RecordingPinning()
    buf = AlignedBuffer(1 << 20, pinning)
    (ptr,) = pinning.live
    assert pinning.live[ptr] == 1 << 20
    assert buf.resize(4 << 20)  # mremap may move it: unpinned, then pinned at its new place and size
    assert list(pinning.live.values()) == [4 << 20]
    assert [c[0] for c in pinning.calls] == ["register", "unregister", "register"]
    view = buf.view(torch.float32, 16)
    del buf
    gc.collect()
    assert len(pinning.live) == 1  # a tensor still views the mapping: it stays pinned
    del view
    gc.collect()
    assert not pinning.live


def test_pinned_host_shards_share_one_arena_sized_by_the_placement(monkeypatch):
    copies = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: copies.append(t.numel()) or t)
    cfg = ds_config(3, 1, offload=True, emulated_accelerator=EMULATOR)
    for key in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][key]["pin_memory"] = True
    engine = make_engine(cfg)
    streams, store = engine.streams, engine.store
    host = [store.get(c.key(s)) for c in engine.chunks
            for s in (State.PARAM, State.MASTER, State.GRAD, State.EXP_AVG, State.EXP_AVG_SQ)
            if (s is not State.MASTER or not c.master_is_param()) and (s is not State.PARAM or not c.plan.resident)
            and store.tier_of(c.key(s)) == HOST]
    assert host and all(streams.pinned(t) for t in host)
    assert len({t.untyped_storage().data_ptr() for t in host}) == 1  # one mapping holds them all
    shard_bytes = engine.memory_report().by_tier[HOST]
    assert shard_bytes <= store.host_arena.held <= shard_bytes + ALIGN_BYTES * len(host) + 4096
    train_engine(engine, batches(2), 0, 1, steps=[0, 1])
    assert streams.h2d_pool is None or streams.h2d_pool.held == 0  # pinned sources are never staged
    assert not copies  # nothing was pinned by copying
    engine.close()


@pytest.mark.parametrize("pin_memory", [False, True])
def test_ssd_staging_buffers_are_pinned_whatever_pin_memory_says(tmp_path, pin_memory):
    """Parameter shards read from SSD reach the device from the buffer they were read into: no staging copy."""
    where = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": pin_memory}
    engine = make_engine(ds_config(3, 1, offload_param=dict(where), offload_optimizer=dict(where),
                                   emulated_accelerator=EMULATOR))
    train_engine(engine, batches(2), 0, 1, steps=[0, 1])
    stats = engine.copy_stats()
    assert stats.h2d_bytes > 0  # the shards did cross to the device
    assert engine.streams.h2d_pool is None or engine.streams.h2d_pool.held == 0
    assert engine.store.param_pool.pinning is engine.streams
    engine.close()


class FakeCudart:
    """The runtime calls CudaPinning makes, with the runtime's per-thread last error: a failed call sets it, and
    cudaGetLastError returns and clears it (a later launch check would raise what is left there)."""

    class cudaError:  # noqa: N801 (the runtime's name)
        success = 0

    def __init__(self, refuse: bool):
        self.refuse, self.last_error, self.registered = refuse, 0, []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802
        if self.refuse:
            self.last_error = 2  # cudaErrorMemoryAllocation
            return 2
        self.registered.append(ptr)
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.registered.remove(ptr)
        return 0

    def cudaGetErrorString(self, err):  # noqa: N802
        return "out of memory"

    def cudaGetLastError(self):  # noqa: N802
        err, self.last_error = self.last_error, 0
        return err


def test_a_refused_registration_leaves_no_last_error_for_the_next_launch_check(caplog):
    refusing = FakeCudart(refuse=True)
    pinning = CudaPinning(refusing)
    buf = torch.zeros(256, dtype=torch.uint8)
    assert not pinning.register(buf.data_ptr(), buf.nbytes)  # it stays pageable, copies are staged
    assert refusing.last_error == 0  # cleared: the next kernel launch does not raise this failure as its own
    assert "could not pin 256 bytes" in caplog.text and not pinning.is_pinned(buf)
    accepting = FakeCudart(refuse=False)
    pinning = CudaPinning(accepting)
    assert pinning.register(buf.data_ptr(), buf.nbytes) and pinning.is_pinned(buf)
    pinning.unregister(buf.data_ptr())
    assert not accepting.registered and not pinning.is_pinned(buf)


def test_the_runtime_takes_cuda_get_last_error_from_the_libcudart_torch_loaded(monkeypatch):
    """torch's runtime bindings have no cudaGetLastError: it comes from the libcudart of torch's CUDA major."""
    from zero_cache import pinned_memory

    runtime, opened = FakeCudart(refuse=True), []

    class Library:
        def __init__(self, name):
            opened.append(name)
            self.cudaGetLastError = lambda: runtime.cudaGetLastError()  # a function: ctypes sets its restype

    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(pinned_memory.ctypes, "CDLL", Library)
    buf = torch.zeros(64, dtype=torch.uint8)
    assert not CudaPinning().register(buf.data_ptr(), buf.nbytes)
    assert opened == ["libcudart.so.13"] and runtime.last_error == 0
