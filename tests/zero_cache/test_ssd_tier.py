"""SSD tier: optimizer states (and parameter shards) on page files under nvme_path, DP=2 numerics against
the fp32 reference, pipelined (read-ahead / write-behind) and plain steps, placement by
prefetch_cache_sub_group_rate, parameter read-ahead, exact resume with everything on SSD, and clear errors
for damaged page files, unwritable paths and full disks."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys

import pytest
import torch

import zero_cache
from tests.dist_utils import run_distributed
from tests.tmpfs import mounted_tmpfs
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
from zero_cache import aio
from zero_cache.aio import SSDTierError
from zero_cache.config import AioConfig
from zero_cache.ssd_store import SWAP_DIR, SSDStore
from zero_cache.states import State

DP = 2
SUB_GROUP = 600  # shard elements per sub-group: the tiny model has 6 sub-groups per rank at DP=2
# (name, prefetch_cache_sub_group_rate, pipeline_optimizer, offload_param)
CASES = [("rate0-pipeline", 0.0, True, "none"), ("rate0-plain", 0.0, False, "none"),
         ("rate0.5-pipeline", 0.5, True, "none"), ("rate1-pipeline", 1.0, True, "none"),
         ("rate0-pipeline-params-on-host", 0.0, True, "cpu"), ("rate0-pipeline-params-on-ssd", 0.0, True, "nvme"),
         ("rate0-plain-params-on-ssd", 0.0, False, "nvme")]


def _nvme_config(world_size, nvme, rate=0.0, pipeline=True, offload_param="none", stage=3, **extra):
    zero = {"sub_group_size": SUB_GROUP, "pipeline_optimizer": pipeline, "prefetch_cache_sub_group_rate": rate,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme}, **extra}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param, "nvme_path": nvme}
    return ds_config(stage, world_size, **zero)


def _engine(config, seed=0):
    model = make_model(seed=seed)
    engine = zero_cache.initialize(model=model, config=config)
    engine.register_external_parameter(model.head, model.embed.weight)
    return engine


def _run_cases(rank, world_size, nvme):
    out = {}
    for name, rate, pipeline, offload_param in CASES:
        engine = _engine(_nvme_config(world_size, nvme, rate, pipeline, offload_param))
        swap_dir = getattr(engine.store, "directory", None)  # rate 1 keeps everything on the device: no SSD
        n_files = len(os.listdir(swap_dir)) if swap_dir else 0
        losses = train_engine(engine, batches(), rank, world_size)
        stats = engine.swap_stats()
        engine.synchronize_writes()  # the last step's write-backs may still be in flight
        # Optimizer staging per sub-group: its SSD states but the parameter shards, which the gathers hand
        # the step as clean copies in the parameter pool.
        staged = {i: len(set(c.opt_swapped()) - {State.PARAM}) * aio.round_up(4 * c.plan.shard)
                  for i, c in enumerate(engine.chunks)}
        sg_bytes = [sum(staged[i] for i in sg) for sg in engine.sub_groups]
        out[name] = {"losses": losses, "weights": to_numpy(engine.gather_state_dict()),
                     "report": engine.memory_report(), "stats": stats, "files": n_files,
                     "sub_group_bytes": sg_bytes, "swapped": list(engine.optimizer.swapped),
                     "chunks": [(c.plan.shard, c.opt_tier) for c in engine.chunks],
                     "ssd": [(c.plan.shard, list(c.swapped), c.opt_swapped()) for c in engine.chunks]}
        engine.close()
        out[name]["removed"] = swap_dir is None or not os.path.exists(swap_dir)
    return out


@pytest.fixture(scope="module")
def ssd_results(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("nvme"))
    results = run_distributed(_run_cases, DP, nvme, timeout=240)
    return results, nvme


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_states_on_ssd_match_reference(ssd_results, reference, case):
    results, nvme = ssd_results
    ref_losses, ref_weights = reference
    losses = [sum(r[case]["losses"][s] for r in results) / DP for s in range(STEPS)]
    assert_close_losses(losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0] - 0.05
    assert_close_weights(results[0][case]["weights"], ref_weights[-1])
    for r in results:
        res = r[case]
        rep = res["report"]
        # Exact accounting: Adam m and v (8 B/elem) of every SSD chunk are page files; fp32 masters are the
        # parameter shards (no separate copy); gradient shards stay in host memory.
        ssd_elems = sum(shard for shard, t in res["chunks"] if t == "nvme")
        assert rep.by_kind_tier.get(("optimizer", "nvme"), 0) == 8 * ssd_elems
        assert rep.by_kind_tier.get(("grads", "nvme"), 0) == 0
        assert rep.by_kind_tier.get(("grads", "host"), 0) == 4 * ssd_elems
        params_on_ssd = sum(shard for shard, names, _ in res["ssd"] if "param" in names)
        assert rep.by_kind_tier.get(("params", "nvme"), 0) == 4 * params_on_ssd
        assert (params_on_ssd > 0) == case.endswith("params-on-ssd")
        assert res["files"] == sum(len(names) for _, names, _ in res["ssd"])  # one page file per SSD shard
        n_sg = len(res["swapped"])
        rate = {"rate0-": 0.0, "rate0.5": 0.5, "rate1-": 1.0}[next(k for k in ("rate0-", "rate0.5", "rate1-")
                                                                   if case.startswith(k))]
        cached = -(-int(rate * 2 * n_sg) // 2)  # ceil(rate * n_sg): the first share stays on the device
        assert res["swapped"] == [k >= cached for k in range(n_sg)]
        if any(res["swapped"]):
            stats = res["stats"]
            file_bytes = sum(len(opt) * (aio.HEADER_BYTES + aio.round_up(4 * shard)) for shard, _, opt in res["ssd"])
            # Each state is written once per step. Read once too, except the parameter shards on SSD: the
            # backward's gathers hand them back as clean copies, which the optimizer takes without I/O.
            param_bytes = sum(aio.HEADER_BYTES + aio.round_up(4 * shard)
                              for shard, _, opt in res["ssd"] if "param" in opt)
            assert (param_bytes > 0) == case.endswith("params-on-ssd")
            assert stats.bytes_written == file_bytes and stats.bytes_read == file_bytes - param_bytes
            assert 0.0 <= stats.overlap <= 1.0 and stats.io_seconds > 0
            sizes = [b for b, s in zip(res["sub_group_bytes"], res["swapped"]) if s]
            if "pipeline" in case:
                # The machine's default host budget leaves room for every SSD sub-group: all are read ahead.
                assert rep.swap_buffers_peak == sum(sizes)
            else:  # one sub-group's staging buffers at a time (the pipeline's bound under a tight budget: test_tiers)
                assert rep.swap_buffers_peak == max(sizes)
            assert rep.swap_buffers_now == 0
        else:
            assert res["stats"] is None and rep.by_tier.get("nvme", 0) == 0
        assert res["removed"]  # close() removes the swap directory
    assert os.listdir(os.path.join(nvme, SWAP_DIR)) == []


def test_pipeline_keeps_more_sub_groups_in_flight(ssd_results):
    """Read-ahead of i+1 and write-behind of i-1 overlap the update of i: more staging buffers in use."""
    results, _ = ssd_results
    piped = results[0]["rate0-pipeline"]["report"].swap_buffers_peak
    plain = results[0]["rate0-plain"]["report"].swap_buffers_peak
    assert piped >= 2 * plain > 0


def _param_read_ahead(rank, world_size, nvme):
    """Ordered log of SSD parameter reads and all-gathers over two steps."""
    engine = _engine(_nvme_config(world_size, nvme, offload_param="nvme", is_communication_time_profiling=True))
    events = engine.profiler.events
    swap_in = engine.store.swap_in

    def logged(keys, for_gather=False, optional=False, **kw):
        handle = swap_in(keys, for_gather, optional, **kw)
        if handle is not None:
            events.append(("ssd_read" if for_gather else "ssd_read_states", keys[0]))
        return handle

    engine.store.swap_in = logged
    steps = []
    for s in range(2):
        train_engine(engine, batches(2), rank, world_size, steps=[s])
        steps.append([e if isinstance(e, tuple) else (e.op, e.tag) for e in events])
        events.clear()
    engine.synchronize_writes()
    report = engine.memory_report()
    engine.close()
    return steps, report


@pytest.mark.multiprocess
def test_parameter_shards_are_read_ahead_of_their_gathers(tmp_path):
    steps, report = run_distributed(_param_read_ahead, DP, str(tmp_path), timeout=180)[0]

    def read_early(events):
        """Gathers whose shard's SSD read was started before some other gather (i.e. read ahead)."""
        early = 0
        for g, (op, tag) in enumerate(events):
            if op != "all_gather" or not tag.startswith("chunk"):
                continue
            read = ("ssd_read", f"c{tag[len('chunk'):]}.param")
            reads = [i for i in range(g) if events[i] == read]
            if not reads:  # a resident chunk (refreshed after the step): not on SSD
                continue
            r = reads[-1]
            early += any(events[i][0] == "all_gather" for i in range(r + 1, g))
        return early

    # By the trace (predicted from the module order in the first step, recorded after), reads run a window
    # ahead of the gathers.
    assert read_early(steps[0]) >= 2 and read_early(steps[1]) >= 2
    for events in steps:  # spare host budget: the optimizer's states are read while the backward runs
        first_read = next(i for i, e in enumerate(events) if e[0] == "ssd_read_states")
        assert first_read < next(i for i, e in enumerate(events) if e[0] == "reduce_scatter")
    assert report.swap_buffers_now == 0 and report.peak_by_tier["host"] <= report.budget["host"]


def _param_reads(rank, world_size, nvme, keep):
    """Per step: SSD reads and all-gathers per chunk with parameter shards on SSD; the losses. ``keep=False``
    takes the keep budget away (every gather reads its shard)."""
    engine = _engine(_nvme_config(world_size, nvme, offload_param="nvme"))
    if not keep:
        engine.coordinator.keep_limit = 0
    counts = []
    swap_in, all_gather = engine.store.swap_in, engine.comm.all_gather

    def read(keys, for_gather=False, optional=False, **kw):
        handle = swap_in(keys, for_gather, optional, **kw)
        if handle is not None and for_gather:
            counts[-1]["read"].append(keys[0].split(".")[0])
        return handle

    def gather(*args, tag="", **kw):
        counts[-1]["gather"].append(tag.replace("chunk", "c"))
        return all_gather(*args, tag=tag, **kw)

    submit = engine.store.aio.submit

    def disk(write, page, buf, account=True):
        if not write and page.key.endswith(".param"):
            counts[-1]["disk"].append(page.key.split(".")[0])
        return submit(write, page, buf, account)

    engine.store.swap_in, engine.comm.all_gather, engine.store.aio.submit = read, gather, disk
    losses = []
    for s in range(3):
        counts.append({"read": [], "gather": [], "disk": []})
        losses += train_engine(engine, batches(3), rank, world_size, steps=[s])
    limit, on_ssd = engine.coordinator.keep_limit, [f"c{c.index}" for c in engine.chunks if c.on_ssd(State.PARAM)]
    engine.close()
    return counts, losses, limit, on_ssd


@pytest.mark.multiprocess
def test_parameter_shards_are_read_from_ssd_once(tmp_path):
    kept = run_distributed(_param_reads, DP, str(tmp_path / "keep"), True, timeout=180)[0]
    plain = run_distributed(_param_reads, DP, str(tmp_path / "plain"), False, timeout=180)[0]
    counts, losses, limit, on_ssd = kept
    assert limit > 0 and on_ssd  # the machine's default host budget holds every shard
    for step in counts:
        assert sorted(step["read"]) == sorted(on_ssd)  # the gathers ask for each shard once per step
        assert all(step["gather"].count(c) >= 2 for c in on_ssd)  # though gathered for forward and backward
    # From the disk: once in the first forward; then never, because the optimizer's written shards stay as
    # clean copies for the next forward, and the backward's are handed to the optimizer the same way.
    assert sorted(counts[0]["disk"]) == sorted(on_ssd) and counts[1]["disk"] == counts[2]["disk"] == []
    for step in plain[0]:  # without the budget, every gather asks for its shard again
        assert all(step["read"].count(c) == step["gather"].count(c) for c in on_ssd)
    assert losses == plain[1]  # bit for bit


# ---- resume -----------------------------------------------------------------------------------------------
def _train_and_save(rank, world_size, nvme, ckpt_dir):
    engine = _engine(_nvme_config(world_size, nvme, offload_param="nvme"))
    first = train_engine(engine, batches(), rank, world_size, steps=range(5))
    engine.save_checkpoint(ckpt_dir, client_state={"iteration": 5})
    rest = train_engine(engine, batches(), rank, world_size, steps=range(5, 10))
    engine.close()
    return first, rest


def _resume(rank, world_size, nvme, ckpt_dir):
    engine = _engine(_nvme_config(world_size, nvme, offload_param="nvme"), seed=123)
    _, client = engine.load_checkpoint(ckpt_dir)
    assert client == {"iteration": 5}
    rest = train_engine(engine, batches(), rank, world_size, steps=range(5, 10))
    engine.close()
    return rest


@pytest.mark.multiprocess
def test_resume_with_states_on_ssd_is_exact(tmp_path):
    nvme, ckpt = str(tmp_path / "nvme"), str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, DP, nvme, ckpt, timeout=180)
    resumed = run_distributed(_resume, DP, nvme, ckpt, timeout=180)
    for r in range(DP):
        assert resumed[r] == saved[r][1], f"rank {r}: resumed steps 6-10 differ"


# ---- page files and errors (single process) -------------------------------------------------------------
def _store(path, **kw):
    return SSDStore(torch.device("cpu"), str(path), AioConfig(block_size=8192, queue_depth=2), **kw)


def _page_path(store, key):
    return os.path.join(store.directory, key + ".swp")


@pytest.mark.parametrize("numel", [3000, 30000])  # 2 and 15 blocks of 8 KiB, two requests in flight
def test_page_file_round_trip_and_layout(tmp_path, numel):
    store = _store(tmp_path)
    values = torch.randn(numel)
    assert store.allocate("c0.exp_avg", "optimizer", "nvme", numel, torch.float32) is None
    assert torch.equal(store.read("c0.exp_avg"), torch.zeros(numel))
    store.put("c0.exp_avg", values)
    (t,) = store.swap_in(["c0.exp_avg"]).wait()
    assert torch.equal(t, values)
    t.mul_(2)
    store.swap_out(["c0.exp_avg"], [t]).wait()
    assert torch.equal(store.read("c0.exp_avg"), 2 * values)
    size = os.path.getsize(_page_path(store, "c0.exp_avg"))
    assert size == aio.HEADER_BYTES + aio.round_up(numel * 4) and size % 4096 == 0  # block-aligned
    assert store.nbytes() == {("optimizer", "nvme"): numel * 4}
    assert store.pool.in_use == 0
    store.close()
    assert not os.path.exists(store.directory)


def test_staging_pool_at_its_limit_resizes_a_free_buffer_instead_of_mapping_a_new_one():
    mib = 1 << 20
    pool = aio.BufferPool(limit=3 * mib)
    first = pool.acquire(2 * mib)
    first.mm[:5] = b"pages"
    pool.release(first)
    grown = pool.acquire(3 * mib)  # 2 + 3 MiB would pass the limit: the free 2 MiB buffer grows
    assert grown is first and grown.capacity == len(grown.mm) == 3 * mib
    assert grown.mm[:5] == b"pages"  # the same pages, still mapped
    grown.mm[-1] = 1  # the new part is usable
    assert (pool.held, pool.in_use) == (3 * mib, 3 * mib)
    pool.release(grown)
    other = pool.acquire(3 * mib)
    assert other is grown  # the same size: taken as it is
    pool.release(other)
    shrunk = pool.acquire(mib)  # 3 + 1 MiB would pass the limit: the free 3 MiB buffer shrinks
    assert shrunk is grown and len(shrunk.mm) == mib and shrunk.mm[:5] == b"pages"
    assert (pool.held, pool.in_use) == (mib, mib)
    pool.release(shrunk)

    # A buffer a tensor still views cannot be resized: a new one is mapped and the accounting stays exact.
    tight = aio.BufferPool(limit=2 * mib)
    buf = tight.acquire(mib)
    view = buf.view(torch.float32, 16)
    tight.release(buf)
    fresh = tight.acquire(2 * mib)
    assert fresh is not buf and fresh.capacity == 2 * mib
    assert (tight.held, tight.in_use) == (2 * mib, 2 * mib)
    del view


def _vm_flags(buf: aio.AlignedBuffer) -> list[str]:
    """The kernel's VmFlags of the mapping that holds ``buf`` (/proc/self/smaps)."""
    addr = buf.view(torch.uint8, 1).data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds address {addr:#x}")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="the kernel has no transparent huge pages (not Linux, or built without them)")
def test_staging_buffers_ask_for_huge_pages_and_keep_them_when_resized():
    big = aio.AlignedBuffer(4 << 20)
    assert "hg" in _vm_flags(big)  # MADV_HUGEPAGE: the kernel backs the buffer with 2 MiB pages
    assert big.resize(6 << 20) and "hg" in _vm_flags(big)  # mremap keeps the advice
    big.mm[-1] = 1
    small = aio.AlignedBuffer(aio.HEADER_BYTES)  # smaller than a huge page: no advice, no 2 MiB page for it
    assert "hg" not in _vm_flags(small)
    assert small.resize(4 << 20) and "hg" in _vm_flags(small)  # grown past a huge page: advised then


def test_page_files_round_trip_through_resized_staging_buffers(tmp_path, monkeypatch):
    resized = []
    real_resize = aio.AlignedBuffer.resize
    monkeypatch.setattr(aio.AlignedBuffer, "resize", lambda buf, cap: resized.append(cap) or real_resize(buf, cap))
    store = _store(tmp_path)
    store.pool.limit = aio.round_up(30000 * 4)  # one buffer: every swap_in of the other key resizes it
    sizes = {"small": 3000, "large": 30000}
    values = {k: torch.randn(n) for k, n in sizes.items()}
    for key, n in sizes.items():
        store.allocate(key, "optimizer", "nvme", n, torch.float32)
        store.put(key, values[key])
    for key in ["small", "large", "small", "large"]:
        (t,) = store.swap_in([key]).wait()
        assert torch.equal(t, values[key])
        t.add_(1)
        values[key] = t.clone()
        store.swap_out([key], [t]).wait()
        del t
    for key in sizes:
        assert torch.equal(store.read(key), values[key])
    assert len(resized) >= 4 and store.pool.held <= store.pool.limit
    store.close()


@pytest.mark.parametrize("damage", ["flip-payload", "truncate", "header"])
def test_damaged_page_file_is_a_clear_error(tmp_path, damage):
    store = _store(tmp_path)
    store.allocate("c1.exp_avg_sq", "optimizer", "nvme", 20000, torch.float32)  # 10 blocks
    store.put("c1.exp_avg_sq", torch.ones(20000))
    path = _page_path(store, "c1.exp_avg_sq")
    with open(path, "r+b") as f:
        if damage == "flip-payload":  # in the ninth block, read while others are in flight
            f.seek(aio.HEADER_BYTES + 70000)
            byte = f.read(1)
            f.seek(aio.HEADER_BYTES + 70000)
            f.write(bytes([byte[0] ^ 0x40]))
        elif damage == "truncate":
            f.truncate(aio.HEADER_BYTES + 1000)
        else:
            f.write(b"garbage!")
    expected = {"flip-payload": "is corrupted: payload checksum", "truncate": "is truncated",
                "header": "corrupted header"}[damage]
    with pytest.raises(SSDTierError, match=expected) as e:
        store.read("c1.exp_avg_sq")
    assert path in str(e.value)
    assert store.pool.in_use == 0  # the failed read handed its buffer back
    store.close()


def test_corrupted_state_during_training_stops_the_step(tmp_path):
    engine = _engine(_nvme_config(1, str(tmp_path)))
    train_engine(engine, batches(2), 0, 1, steps=[0])
    engine.synchronize_writes()  # damage the file after the step's write-back, not under it
    victim = os.path.join(engine.store.directory, "c2.exp_avg.swp")
    with open(victim, "r+b") as f:
        f.seek(aio.HEADER_BYTES)
        f.write(b"\xff" * 16)
    with pytest.raises(SSDTierError, match=f"'{victim}' is corrupted"):
        train_engine(engine, batches(2), 0, 1, steps=[1])
        engine.finish_update()  # the update runs under the next forward: its error surfaces where it is needed
    assert engine.store.pool.in_use == 0  # no staging buffer is left in use or targeted by I/O
    engine.close()


def test_unwritable_nvme_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SSDTierError, match="is not a writable directory") as e:
        _engine(_nvme_config(1, str(blocker / "nvme")))
    assert str(blocker / "nvme") in str(e.value)
    with mounted_tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(SSDTierError, match=f"nvme_path '{ro}/swap' is on a read-only filesystem \\('{ro}' is "
                                               f"mounted read-only\\); point .*nvme_path at a writable directory"):
            _engine(_nvme_config(1, str(ro / "swap")))


def test_small_read_only_filesystem_is_reported_as_read_only_not_as_full(tmp_path):
    """Its free space is below the states' size: the space check alone would blame the size of the disk."""
    with mounted_tmpfs(tmp_path / "ro", "16k", read_only=True) as ro:
        with pytest.raises(SSDTierError, match="read-only filesystem") as e:
            _engine(_nvme_config(1, str(ro)))
        assert "budget" not in str(e.value) and "space" not in str(e.value)


def test_full_disk_is_a_clear_error_with_bytes_needed_and_free(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        store = _store(small)
        store.allocate("c0.exp_avg", "optimizer", "nvme", 100_000, torch.float32)  # 400 KB fits
        with pytest.raises(SSDTierError, match=r"no space left for '.*c1.exp_avg.swp': 2101248 bytes needed, "
                                               r"\d+ bytes free"):
            store.allocate("c1.exp_avg", "optimizer", "nvme", 524_288, torch.float32)  # 2 MiB does not
        assert torch.equal(store.read("c0.exp_avg"), torch.zeros(100_000))  # what fitted is intact
        store.close()
        assert os.listdir(small / SWAP_DIR) == []


def test_stale_swap_dirs_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket
    stale = tmp_path / SWAP_DIR / f"{socket.gethostname()}_pid{dead.pid}_r0"
    stale.mkdir(parents=True)
    (stale / "c0.exp_avg.swp").write_bytes(b"x" * 4096)
    store = _store(tmp_path)
    assert not stale.exists() and os.path.isdir(store.directory)
    store.close()


def test_falls_back_to_buffered_io_when_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(aio.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="zero_cache.aio"):
        store = _store(tmp_path)
        for i in range(3):
            store.allocate(f"c{i}.exp_avg", "optimizer", "nvme", 1000, torch.float32)
        store.put("c2.exp_avg", torch.arange(1000.0))
        assert torch.equal(store.read("c2.exp_avg"), torch.arange(1000.0))
    warnings = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1  # warned once, later files skip O_DIRECT
    store.close()


@pytest.mark.multiprocess
def test_swap_directory_is_removed_at_exit_without_close(tmp_path):
    code = ("import sys, torch; from zero_cache.ssd_store import SSDStore; from zero_cache.config import AioConfig\n"
            f"s = SSDStore(torch.device('cpu'), {str(tmp_path)!r}, AioConfig())\n"
            "s.allocate('c0.exp_avg', 'optimizer', 'nvme', 1000, torch.float32)\n"
            "print(s.directory)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr
    directory = proc.stdout.strip()
    assert directory.startswith(str(tmp_path)) and not os.path.exists(directory)


def test_bf16_with_params_and_states_on_ssd_is_bit_identical_to_in_memory(tmp_path):
    """Swapping is exact: bf16 parameter shards and fp32 masters/moments on SSD give the in-memory run's numbers."""
    runs = {}
    for name, zero in (("memory", {}),
                       ("ssd", {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}),
                       ("params-ssd-states-host", {"offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}})):
        cfg = ds_config(3, 1, sub_group_size=SUB_GROUP, **zero) | {"bf16": {"enabled": True}}
        engine = _engine(cfg)
        losses = train_engine(engine, batches(4), 0, 1)
        runs[name] = (losses, engine.gather_state_dict(), engine.memory_report())
        engine.close()
    for name in ("ssd", "params-ssd-states-host"):
        assert runs[name][0] == runs["memory"][0]
        for k, v in runs["memory"][1].items():
            assert torch.equal(runs[name][1][k], v), k
    ssd = runs["ssd"][2].by_kind_tier
    assert ssd[("params", "nvme")] > 0 and ssd[("optimizer", "nvme")] > 0
    assert runs["params-ssd-states-host"][2].by_kind_tier[("optimizer", "host")] > 0
    assert runs["memory"][0][-1] < runs["memory"][0][0] - 0.05


def test_log_line_shows_tiers_and_overlap(tmp_path, caplog):
    engine = _engine(_nvme_config(1, str(tmp_path)) | {"steps_per_print": 1})
    with caplog.at_level(logging.INFO, logger="zero_cache.engine"):
        train_engine(engine, batches(2), 0, 1, steps=[0])
        rep = engine.memory_report()
        engine.close()
    lines = [r.getMessage() for r in caplog.records]
    (line,) = [m for m in lines if m.startswith("zero_cache step 1:")]
    # The update runs under the next forward (here: until close), so its SSD traffic has a line of its own.
    (update,) = [m for m in lines if m.startswith("zero_cache step 1, update under the next forward:")]
    assert "SSD read" in update and "hidden" in update
    nvme_mib = rep.by_kind_tier[("optimizer", "nvme")] / 2**20
    assert f"nvme={nvme_mib:.2f}MiB [optimizer={nvme_mib:.2f}]" in line
