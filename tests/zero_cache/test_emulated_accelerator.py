"""The emulated accelerator (zero_optimization.emulated_accelerator): host <-> device copies on their own
streams, at a bandwidth and with random delays, checked against the single-process fp32 reference.

DP=2 with offload cpu and nvme at prefetch_cache_sub_group_rate 0, 0.5 and 1 (the heterogeneous optimizer:
device sub-groups on the training thread, host and SSD ones on the host lane), pinned host shards, and the
speculative host update: per-step losses within 1e-5 over 10 steps and the final weights. The host's
update runs under the next forward (overlap_optimizer_step) except where a case turns that off. Then the
harness is shown to catch races: removing one wait (the all-gather's wait for its shard's copy, the host
lane's wait for a gradient's copy, or the compute stream's wait for a bf16 parameter shard the overlapped
update copied to the device) gives wrong numbers. Also: the emulator's own semantics, the config rule, and the
per-step copy report in the log line, and the line of the host's update under the next forward."""
from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    CLIP,
    GAS,
    STEPS,
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    make_engine,
    rank_micro_batches,
    reference_run,
    to_numpy,
)
from zero_cache.comm import Comm
from zero_cache.config import EmulatedAcceleratorConfig, ZeroConfigError, parse_config
from zero_cache.emulator import EmulatedStreams
from zero_cache.grad_reducer import GradReducer
from zero_cache.streams import DONE, make_streams
from zero_cache.update import OverlappedUpdate

DP = 2
# Slow enough that every copy is still in flight when a reader that skips its wait looks.
EMULATOR = {"enabled": True, "h2d_gbps": 0.05, "d2h_gbps": 0.05, "random_delay_ms": 2.0}
SUB_GROUP = 600  # shard elements per sub-group: 6 sub-groups per rank at DP=2
# (name, optimizer/parameter offload device, prefetch_cache_sub_group_rate, extra zero_optimization keys)
CASES = [("cpu-rate0", "cpu", 0.0, {}), ("cpu-rate0.5", "cpu", 0.5, {}), ("cpu-rate1", "cpu", 1.0, {}),
         ("nvme-rate0", "nvme", 0.0, {}), ("nvme-rate0.5", "nvme", 0.5, {}), ("nvme-rate1", "nvme", 1.0, {}),
         ("cpu-pinned-speculative", "cpu", 0.0, {"speculative_update": True}),
         ("cpu-rate0.5-waiting", "cpu", 0.5, {"overlap_optimizer_step": False}),
         ("nvme-rate0.5-waiting", "nvme", 0.5, {"overlap_optimizer_step": False})]
# Cases whose update does not run under the next forward: every sub-group on the device, speculation, or off.
WAITING = {"cpu-rate1", "nvme-rate1", "cpu-pinned-speculative", "cpu-rate0.5-waiting", "nvme-rate0.5-waiting"}


def _config(world_size: int, offload: str, rate: float, nvme: str = "", emulator=None, **extra) -> dict:
    where = {"device": offload, "nvme_path": nvme} if offload == "nvme" else {"device": offload}
    if extra.get("speculative_update"):
        where["pin_memory"] = True
    zero = {"sub_group_size": SUB_GROUP, "prefetch_cache_sub_group_rate": rate, "offload_optimizer": dict(where),
            "offload_param": dict(where), "emulated_accelerator": dict(emulator or EMULATOR), **extra}
    return ds_config(3, world_size, **zero)


def _train(engine, rank: int, world_size: int, steps: int = STEPS):
    """Losses, each step's copy and speculation reports, and whether each step returned with its update still
    running."""
    data = batches(steps)
    losses, copies, speculation, running = [], [], [], []
    for s in range(steps):
        micro = []
        for mb in rank_micro_batches(data[s], rank, world_size):
            loss = engine(mb)
            micro.append(loss.item())
            engine.backward(loss)
        engine.step()
        running.append(engine.update.in_flight())
        losses.append(sum(micro) / len(micro))
        copies.append(engine.copy_stats())
        speculation.append(engine.last_speculation)
    return losses, copies, speculation, running


def _run_cases(rank, world_size, nvme):
    out = {}
    for name, offload, rate, extra in CASES:
        engine = make_engine(_config(world_size, offload, rate, nvme, **extra))
        losses, copies, spec, running = _train(engine, rank, world_size)
        host_grads = [c.plan.shard for c in engine.chunks if engine.reducer.to_host[c.index]]
        held = [engine.chunks[c].plan.shard for c in engine.reducer.keep if engine.reducer.to_host[c]]
        out[name] = {"losses": losses, "weights": to_numpy(engine.gather_state_dict()), "copies": copies,
                     "speculation": spec, "running": running, "host_grad_elems": sum(host_grads),
                     "held_grad_elems": sum(held),
                     "device_sub_groups": sum(engine.optimizer.on_device), "sub_groups": len(engine.sub_groups),
                     "lane": engine.lane is not None, "report": engine.memory_report(),
                     "reserved_staging": engine.store.copy_staging}
        engine.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("nvme"))
    return run_distributed(_run_cases, DP, nvme, timeout=300)


@pytest.fixture(scope="module")
def reference():
    norms: list[float] = []
    losses, weights = reference_run(norms=norms)
    return losses, weights, norms


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_reference_with_emulated_copies(results, reference, case):
    ref_losses, ref_weights, _ = reference
    losses = [sum(r[case]["losses"][s] for r in results) / DP for s in range(STEPS)]
    assert_close_losses(losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0] - 0.05
    assert_close_weights(results[0][case]["weights"], ref_weights[-1])
    rate = next(c[2] for c in CASES if c[0] == case)
    for r in results:
        res = r[case]
        assert res["running"] == [case not in WAITING] * STEPS
        # The first ceil(rate x sub-groups) sub-groups update on the device, beside the host lane.
        assert res["device_sub_groups"] == -(-int(2 * rate * res["sub_groups"]) // 2)
        for stats in res["copies"]:
            # One device-to-host copy per host gradient shard per micro-batch, of its fp32 shard; one per step
            # for a chunk whose gradient buffer is held across the micro-batches (grad_reducer.py).
            assert stats.d2h_bytes == 4 * (GAS * res["host_grad_elems"] - (GAS - 1) * res["held_grad_elems"])
            assert (stats.h2d_bytes > 0) == (rate < 1.0)
            assert stats.issued_seconds > 0 or stats.copies == 0
            assert 0.0 <= stats.hidden <= 1.0
        if rate < 1.0:  # the pinned pools held no more than the host budget reserved for them
            assert res["lane"] and 0 < res["report"].copy_staging <= res["reserved_staging"]


@pytest.mark.multiprocess
def test_speculation_is_accepted_without_clipping_and_redone_with_it(results, reference):
    _, _, norms = reference
    for r in results:
        for step, (stats, norm) in enumerate(zip(r["cpu-pinned-speculative"]["speculation"], norms)):
            assert stats.speculated > 0, f"step {step + 1}"
            if norm > CLIP:  # clipped: every speculated sub-group was restored, then updated by the step
                assert (stats.accepted, stats.restored) == (0, stats.speculated), f"step {step + 1}"
            else:
                assert (stats.accepted, stats.restored) == (stats.speculated, 0), f"step {step + 1}"
    assert any(n > CLIP for n in norms) and any(n <= CLIP for n in norms)  # both outcomes were exercised


# ---- the harness catches races (one process: no spawn) --------------------------------------------------
def _single_process_losses(steps: int = 2) -> list[float]:
    # Gathers on demand (no prefetch): each is waited for right after it is issued, while its copy is in flight.
    engine = make_engine(_config(1, "cpu", 0.0, emulator={**EMULATOR, "random_delay_ms": 0.0},
                                 stage3_prefetch_bucket_size=0))
    try:
        return _train(engine, 0, 1, steps)[0]
    finally:
        engine.close()


def test_without_race_the_single_process_run_matches():
    assert_close_losses(_single_process_losses(), reference_run(steps=2)[0])


def test_gather_that_skips_its_copy_wait_gives_wrong_numbers(monkeypatch):
    original = Comm.all_gather

    def no_wait(self, out, shard, tag="", async_op=False, after=None):
        return original(self, out, shard, tag, async_op, None if after is None else DONE)
    monkeypatch.setattr(Comm, "all_gather", no_wait)
    with pytest.raises(AssertionError):
        assert_close_losses(_single_process_losses(), reference_run(steps=2)[0])


def test_gradient_read_before_its_copy_lands_gives_wrong_numbers(monkeypatch):
    original = GradReducer._land

    def no_wait(self, c, staged, landed, *rest):
        return original(self, c, staged, DONE, *rest)
    monkeypatch.setattr(GradReducer, "_land", no_wait)
    with pytest.raises(AssertionError):
        assert_close_losses(_single_process_losses(), reference_run(steps=2)[0])


def test_update_under_the_forward_copies_bf16_shards_to_the_device_and_the_forward_waits_for_them(monkeypatch):
    """bf16 parameter shards on the device, fp32 masters in host memory: the update under the next forward
    copies each shard back to the device, and the compute stream waits for that copy before the shard's gather.
    Bit-identical to the waiting step; without that wait the forward reads shards still in flight."""
    # Copies to the device slow enough that most are still in flight when the forward gathers their chunks.
    slow = {**EMULATOR, "h2d_gbps": 4e-5, "random_delay_ms": 0.0}

    def run(overlap: bool) -> tuple[list[float], dict, list[bool]]:
        cfg = _config(1, "cpu", 0.0, emulator=slow, offload_param={"device": "none"},
                      overlap_optimizer_step=overlap) | {"bf16": {"enabled": True}}
        engine = make_engine(cfg)
        try:
            assert all(engine.optimizer.crossing.values())  # every write-back is a copy to the device
            losses, _, _, running = _train(engine, 0, 1, steps=3)
            return losses, engine.gather_state_dict(), running
        finally:
            engine.close()

    waiting, overlapped = run(False), run(True)
    assert waiting[2] == [False] * 3 and overlapped[2] == [True] * 3
    assert overlapped[0] == waiting[0]
    for name, w in waiting[1].items():
        assert torch.equal(overlapped[1][name], w), name
    monkeypatch.setattr(OverlappedUpdate, "_hand_copy", lambda self, chunk: self._landing.pop(chunk, None))
    assert run(True)[0] != waiting[0]  # a gather read a shard still in flight (the emulator's NaN)


# ---- the emulator itself, the config, the report ---------------------------------------------------------
def test_emulated_copy_is_nan_until_it_lands_and_streams_keep_order():
    streams = EmulatedStreams(EmulatedAcceleratorConfig(enabled=True, h2d_gbps=1e-4, d2h_gbps=1.0))
    streams.configure_staging(4096, 4096)
    try:
        src = torch.arange(256, dtype=torch.float32)  # 1 KiB at 1e5 B/s: 10 ms in flight
        dst = torch.zeros(256)
        first = streams.h2d(dst, src)
        assert first.source_free.query()  # pageable: staged into pinned memory at once, free to change
        src.fill_(-1.0)
        second = torch.zeros(256)
        later = streams.h2d(second, torch.ones(256))
        first.done.synchronize()
        assert torch.equal(dst, torch.arange(256, dtype=torch.float32))  # the staged values landed
        assert not later.done.query() or torch.equal(second, torch.ones(256))  # in order, after the first
        streams.wait(later.done)
        assert torch.equal(second, torch.ones(256))
        stats = streams.take_stats()
        assert stats.copies == 2 and stats.h2d_bytes == 2 * 1024
    finally:
        streams.close()

    # A copy in flight for 0.5 s, so that a loaded machine still polls inside the window.
    slow = EmulatedStreams(EmulatedAcceleratorConfig(enabled=True, h2d_gbps=2e-6, d2h_gbps=1.0))
    slow.configure_staging(4096, 4096)
    try:
        out = torch.zeros(256)
        landing = slow.h2d(out, torch.ones(256)).done
        saw_nan = False
        while not saw_nan and not landing.query():  # in flight, the destination holds NaN
            saw_nan = bool(torch.isnan(out).all())
            time.sleep(0.001)
        slow.wait(landing)
        assert saw_nan and torch.equal(out, torch.ones(256))
        stats = slow.take_stats()
        assert stats.copies == 1 and stats.h2d_bytes == 1024 and stats.blocked_seconds > 0  # the wait is metered
    finally:
        slow.close()


def test_staging_pool_is_bounded_and_reuses_a_buffer_only_after_its_copy():
    # 1 KiB at 1e4 B/s: each copy in flight for 100 ms, so the second and third find the first still running.
    streams = EmulatedStreams(EmulatedAcceleratorConfig(enabled=True, h2d_gbps=1e-5, d2h_gbps=1.0))
    streams.configure_staging(1024, 0)
    try:
        dsts = [torch.zeros(256) for _ in range(3)]
        copies = [streams.h2d(d, torch.full((256,), float(i))) for i, d in enumerate(dsts)]
        assert streams.staging_bytes == 2 * 1024  # double-buffered: the third copy waited for the first's buffer
        for c in copies:
            c.done.synchronize()
        for i, d in enumerate(dsts):
            assert torch.equal(d, torch.full((256,), float(i)))  # no buffer was refilled under a running copy
    finally:
        streams.close()


def test_emulator_is_accepted_only_on_cpu_compute():
    cfg = parse_config(ds_config(3, 1, emulated_accelerator={"enabled": True, "h2d_gbps": 12.5}))
    assert cfg.zero_optimization.emulated_accelerator.h2d_gbps == 12.5
    with pytest.raises(ZeroConfigError, match="emulated_accelerator.*CPU compute"):
        make_streams(cfg, torch.device("cuda", 0))
    with pytest.raises(ZeroConfigError, match="h2d_gbps"):
        parse_config(ds_config(3, 1, emulated_accelerator={"enabled": True, "h2d_gbps": 0}))
    with pytest.raises(ZeroConfigError, match="speculative_update.*lock_free_update"):
        parse_config(ds_config(3, 1, offload=True, speculative_update=True, lock_free_update=True))
    with pytest.raises(ZeroConfigError, match="speculative_update.*loss scale"):
        parse_config(ds_config(3, 1, offload=True, speculative_update=True) | {"fp16": {"enabled": True}})


def test_log_line_shows_copy_time_issued_and_blocked(caplog):
    engine = make_engine(_config(1, "cpu", 0.0) | {"steps_per_print": 1})
    with caplog.at_level(logging.INFO, logger="zero_cache.engine"):
        _train(engine, 0, 1, steps=1)
    stats = engine.copy_stats()
    engine.close()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("zero_cache step 1:")]
    assert stats.copies > 0 and stats.issued_seconds > 0
    assert f"issued {stats.issued_seconds * 1e3:.1f}ms, blocked compute {stats.blocked_seconds * 1e3:.1f}ms" in line
    assert "hidden" in line and f"D2H {stats.d2h_bytes / 2**20:.2f}MiB" in line


def test_log_line_of_the_host_update_under_the_next_forward(caplog):
    engine = make_engine(_config(1, "cpu", 0.0) | {"steps_per_print": 1})
    with caplog.at_level(logging.INFO, logger="zero_cache.engine"):
        _train(engine, 0, 1, steps=2)  # step 1's update ends under step 2's forward, and is logged then
        engine.close()
    lines = [r.getMessage() for r in caplog.records if "update under the next forward" in r.getMessage()]
    assert len(lines) == 2  # step 2's is finished by close()
    assert re.fullmatch(r"zero_cache step 1, update under the next forward: blocked \d+\.\dms", lines[0])
