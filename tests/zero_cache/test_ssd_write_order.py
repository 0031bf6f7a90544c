"""SSD writes left in flight: a step returns before its write-backs land, and the store keeps every page
file's I/O in order (a read waits for the write to its shard), serves reads before queued writes, takes
staging room back from writes when a read needs it, and reports a failed write at the next access. Clean
copies: a written shard is served without I/O, a stale copy never, and copies give way to reads."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.zero_cache.common import batches, train_engine
from tests.zero_cache.test_ssd_tier import _engine, _nvme_config, _page_path
from zero_cache import aio
from zero_cache.aio import AioEngine, SSDTierError
from zero_cache.config import AioConfig
from zero_cache.ssd_store import SSDStore

N = 20000  # elements per shard: 10 blocks of 8 KiB


class Gate:
    """Holds page-file writes of the keys in ``held`` until ``open()``; logs reads and writes in the order
    they start."""

    def __init__(self, monkeypatch, held=(), fail=()):
        self.held, self.fail = set(held), set(fail)
        self.event = threading.Event()
        self.entered = threading.Event()  # a held write has reached the gate
        self.log: list[tuple[str, str]] = []
        write, read = aio.PageFile.write, aio.PageFile.read

        def gated_write(page, buf, block, pool=None):
            if page.key in self.held:
                self.entered.set()
                assert self.event.wait(30), "the test never opened the gate"
            self.log.append(("write", page.key))
            if page.key in self.fail:
                raise SSDTierError(f"SSD tier: writing '{page.path}' failed: [Errno 5] Input/output error")
            write(page, buf, block, pool)

        def logged_read(page, buf, block, pool=None):
            self.log.append(("read", page.key))
            read(page, buf, block, pool)

        monkeypatch.setattr(aio.PageFile, "write", gated_write)
        monkeypatch.setattr(aio.PageFile, "read", logged_read)

    def open(self):
        self.event.set()


def _store(path, queue_depth=2, **kw):
    return SSDStore(torch.device("cpu"), str(path), AioConfig(block_size=8192, queue_depth=queue_depth), **kw)


def _in_thread(fn):
    """Run ``fn`` on a thread; the thread and a one-item list that receives its result."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def _write(store, key, value):
    """Swap ``key`` in, set it to ``value`` and swap it out, without waiting for the write."""
    (t,) = store.swap_in([key]).wait()
    t.fill_(value)
    return store.swap_out([key], [t])


def test_a_read_waits_for_the_write_in_flight_to_its_shard(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.allocate("c0.exp_avg", "optimizer", "nvme", N, torch.float32)
    gate = Gate(monkeypatch, held={"c0.exp_avg"})
    _write(store, "c0.exp_avg", 3.0)  # returns with the write held
    assert store.pool.in_use > 0  # its staging buffer belongs to the write until it lands
    reader, got = _in_thread(lambda: store.read("c0.exp_avg"))
    reader.join(0.3)
    assert reader.is_alive() and gate.log == [("read", "c0.exp_avg")]  # only the read before the write
    gate.open()
    reader.join(30)
    assert torch.equal(got[0], torch.full((N,), 3.0))
    assert gate.log[1:] == [("write", "c0.exp_avg"), ("read", "c0.exp_avg")]
    assert store.pool.in_use == 0
    store.close()


def test_a_read_waits_for_a_write_another_thread_is_already_waiting_for(tmp_path, monkeypatch):
    """One thread waits for a write (here synchronize_writes; in training the optimizer's update making room
    in the staging pool) while another reads the shard: the write is still in flight for the reader, whose
    read starts only once it has landed."""
    store = _store(tmp_path)
    store.allocate("c0.exp_avg", "optimizer", "nvme", N, torch.float32)
    gate = Gate(monkeypatch, held={"c0.exp_avg"})
    _write(store, "c0.exp_avg", 3.0)
    syncer, _ = _in_thread(store.synchronize_writes)
    syncer.join(0.3)  # now blocked inside the held write
    reader, got = _in_thread(lambda: store.read("c0.exp_avg"))
    reader.join(0.3)
    assert syncer.is_alive() and reader.is_alive() and gate.log == [("read", "c0.exp_avg")]
    gate.open()
    reader.join(30)
    syncer.join(30)
    assert torch.equal(got[0], torch.full((N,), 3.0))
    assert gate.log[1:] == [("write", "c0.exp_avg"), ("read", "c0.exp_avg")]
    store.close()


def test_reads_are_served_before_queued_writes(tmp_path, monkeypatch):
    store = _store(tmp_path, queue_depth=1)  # one I/O worker: the queue decides the order
    for key in ("a", "b", "c"):
        store.allocate(key, "optimizer", "nvme", N, torch.float32)
        store.put(key, torch.full((N,), float(ord(key))))
    gate = Gate(monkeypatch, held={"a"})
    (b,) = store.swap_in(["b"]).wait()  # read now: only its write is to queue behind a's
    _write(store, "a", 1.0)
    assert gate.entered.wait(30)  # the worker is held inside a's write
    b.fill_(2.0)
    store.swap_out(["b"], [b])  # queued behind it
    read_c = store.swap_in(["c"])  # queued last, served first
    gate.open()
    (c,) = read_c.wait()
    store.synchronize_writes()
    assert gate.log[-3:] == [("write", "a"), ("read", "c"), ("write", "b")]
    assert torch.equal(c, torch.full((N,), float(ord("c"))))
    store.release([c])
    assert torch.equal(store.read("b"), torch.full((N,), 2.0))
    store.close()


def test_a_read_takes_its_staging_room_back_from_writes_in_flight(tmp_path, monkeypatch):
    one = aio.round_up(4 * N)
    store = _store(tmp_path, staging_bytes=one)  # room for one shard's staging buffer
    for key in ("a", "b"):
        store.allocate(key, "optimizer", "nvme", N, torch.float32)
    gate = Gate(monkeypatch, held={"a"})
    _write(store, "a", 5.0)
    assert store.swap_in(["b"], optional=True) is None  # a read-ahead never waits for room
    reader, got = _in_thread(lambda: store.swap_in(["b"]).wait())
    reader.join(0.3)
    assert reader.is_alive()  # a read the caller needs waits for the write holding the room
    gate.open()
    reader.join(30)
    (b,) = got[0]
    assert torch.equal(b, torch.zeros(N)) and store.pool.peak_held == one
    store.release([b])
    assert torch.equal(store.read("a"), torch.full((N,), 5.0))
    store.close()


def test_a_failed_write_is_reported_at_the_next_access_to_its_shard(tmp_path, monkeypatch):
    store = _store(tmp_path)
    for key in ("a", "b"):
        store.allocate(key, "optimizer", "nvme", N, torch.float32)
    Gate(monkeypatch, fail={"a", "b"})
    _write(store, "a", 1.0)  # returns: the failure is not known yet
    with pytest.raises(SSDTierError, match=f"writing '{_page_path(store, 'a')}' failed"):
        store.read("a")
    _write(store, "b", 1.0)
    with pytest.raises(SSDTierError, match=f"writing '{_page_path(store, 'b')}' failed"):
        store.synchronize_writes()
    assert store.pool.in_use == 0
    store.close()


def test_busy_time_counts_running_jobs_once_and_bytes_when_submitted(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.allocate("a", "optimizer", "nvme", N, torch.float32)
    engine: AioEngine = store.aio
    engine.busy_seconds_and_reset()
    gate = Gate(monkeypatch, held={"a"})
    _write(store, "a", 1.0)
    assert gate.entered.wait(30)  # the write is running (its busy time started before it reached the gate)
    time.sleep(0.2)
    first_reset = time.perf_counter()
    busy, read, written = engine.busy_seconds_and_reset()  # the write is still running
    page_bytes = aio.HEADER_BYTES + aio.round_up(4 * N)
    assert busy >= 0.2 and read == written == page_bytes
    gate.open()
    store.synchronize_writes()
    busy, read, written = engine.busy_seconds_and_reset()
    # Only its rest, after the first reset: counting the first 0.2 s again would exceed this.
    assert busy <= time.perf_counter() - first_reset and read == written == 0
    store.close()


def test_a_written_shard_is_served_from_its_clean_copy_and_a_stale_one_never(tmp_path, monkeypatch):
    one = aio.round_up(4 * N)
    store = _store(tmp_path, staging_bytes=2 * one, param_staging_bytes=one)
    for key in ("p", "q"):
        store.allocate(key, "params", "nvme", N, torch.float32)
    gate = Gate(monkeypatch)
    (t,) = store.swap_in(["p"]).wait()
    t.fill_(1.0)
    store.swap_out(["p"], [t], keep=["p"]).wait()  # written; the copy moves to the parameter pool
    assert store.cached_bytes(store.param_pool) == one and (store.pool.in_use, store.param_pool.in_use) == (0, one)
    gate.log.clear()
    (t,) = store.swap_in(["p"], for_gather=True).wait()  # served from the copy
    assert gate.log == [] and torch.equal(t, torch.full((N,), 1.0)) and store.cached_bytes() == 0
    store.release([t], clean=True)  # unchanged: cached again
    (old,) = store.swap_in(["p"]).wait()  # taken before the write below...
    store.put("p", torch.full((N,), 2.0))
    store.release([old], clean=True)  # ...so not cached: it no longer equals the page file
    assert store.cached_bytes() == 0 and torch.equal(store.read("p"), torch.full((N,), 2.0))
    (t,) = store.swap_in(["p"]).wait()
    t.fill_(3.0)
    store.swap_out(["p"], [t], keep=["p"]).wait()
    assert store.cached_bytes() == one
    (q,) = store.swap_in(["q"], for_gather=True).wait()  # the parameter pool is full: p's copy makes room
    assert store.cached_bytes() == 0 and ("read", "q") in gate.log
    store.release([q])
    assert torch.equal(store.read("p"), torch.full((N,), 3.0))
    store.close()


def test_a_gather_read_waits_for_a_write_holding_the_parameter_pool(tmp_path, monkeypatch):
    one = aio.round_up(4 * N)
    store = _store(tmp_path, staging_bytes=one, param_staging_bytes=one)
    for key in ("p", "q"):
        store.allocate(key, "params", "nvme", N, torch.float32)
    gate = Gate(monkeypatch, held={"p"})
    (t,) = store.swap_in(["p"]).wait()
    gate.open()
    store.swap_out(["p"], [t], keep=["p"]).wait()  # a clean copy in the parameter pool
    gate.event.clear()
    (t,) = store.swap_in(["p"]).wait()  # the optimizer takes it (a parameter-pool buffer) and writes it again
    t.fill_(4.0)
    store.swap_out(["p"], [t], keep=["p"])
    reader, got = _in_thread(lambda: store.swap_in(["q"], for_gather=True).wait())
    reader.join(0.3)
    assert reader.is_alive()  # waits for the write that holds the pool's room, instead of failing
    gate.open()
    reader.join(30)
    (q,) = got[0]
    assert torch.equal(q, torch.zeros(N))
    store.release([q])
    assert torch.equal(store.read("p"), torch.full((N,), 4.0))
    store.close()


def _losses(path, monkeypatch=None, steps=3):
    """Losses and final weights; with ``monkeypatch``, the first step's SSD write-backs are held until it has
    returned (and the test checks that it does)."""
    engine = _engine(_nvme_config(1, str(path)))
    losses = []
    if monkeypatch is not None:
        keys = {c.key(state) for c in engine.chunks for state in c.opt_swapped()}
        gate = Gate(monkeypatch, held=keys)
        stepper, out = _in_thread(lambda: train_engine(engine, batches(steps), 0, 1, steps=[0]))
        stepper.join(60)
        returned = not stepper.is_alive()
        landed = [k for op, k in gate.log if op == "write"]
        gate.open()  # the next step's reads wait for these writes; never leave the step hanging
        stepper.join(60)
        assert returned, "the step waited for its SSD write-backs"
        assert keys and landed == []  # it returned with every write-back in flight
        losses += out[0]
    for s in range(len(losses), steps):
        losses += train_engine(engine, batches(steps), 0, 1, steps=[s])
    weights = engine.gather_state_dict()
    engine.close()
    return losses, weights


def test_a_step_returns_before_its_ssd_writes_and_the_next_step_is_exact(tmp_path, monkeypatch):
    plain = _losses(tmp_path / "plain")
    held = _losses(tmp_path / "held", monkeypatch)
    assert held[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(held[1][name], value), name
