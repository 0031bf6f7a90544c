"""Communication profiling: per-step collectives measured on DP=2 against the ZeRO theory, stages 1-3."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import ds_config
from zero_cache.comm import COLLECTIVES, CollectiveTotals
from zero_cache.comm_theory import zero_step_theory
from zero_cache.partition import ChunkPlan

DP, STEPS, WIDTH = 2, 3, 16
PART, RES = 512 + 1024 + 512, 112  # stage 3: elements in partitioned chunks, in the one resident chunk
NO_REUSE = {"stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0}  # nothing kept between uses


class Chain(nn.Module):
    """Stage 3: each Linear weight fills a chunk (page 1100 elements) used by that module alone; the biases
    and the LayerNorm are below the persistence threshold (100) and share one resident chunk."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(WIDTH, 32), nn.Linear(32, 32), nn.Linear(32, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))).pow(2).mean()


def _run(rank, world_size, stage, gas=2, precision=None, overflow_step=None, steps_per_print=10, **zero):
    config = ds_config(stage, world_size, is_communication_time_profiling=True, **zero)
    config.update(gradient_accumulation_steps=gas, steps_per_print=steps_per_print)
    if precision is not None:
        config[precision] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8} if precision == "fp16" \
            else {"enabled": True}
    torch.manual_seed(0)
    engine = zero_cache.initialize(model=Chain(), config=config)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("zero_cache.engine")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    g = torch.Generator().manual_seed(rank)
    stats = []
    for s in range(STEPS):
        for _ in range(gas):
            loss = engine(torch.randn(8 // (gas * world_size), WIDTH, generator=g).to(engine.dtype))
            if s == overflow_step and rank == 0:
                loss = loss * float("inf")
            engine.backward(loss)
        result = engine.step()
        stats.append((engine.last_comm_stats, result.skipped))
    log.removeHandler(handler)
    return {"stats": stats, "plans": [(c.plan.resident, c.plan.padded) for c in engine.chunks],
            "messages": [m for m in messages if m.startswith("zero_cache comm")]}


def _counts_bytes(stats, kind):
    m = stats.measured[kind]
    return m.count, m.nbytes


CASES = {"s3": (3, {}), "s3_gas1": (3, {"gas": 1}), "s3_reuse": (3, {"reuse": True}),
         "s2": (2, {}), "s2_gas1": (2, {"gas": 1}), "s1": (1, {}), "s1_gas1": (1, {"gas": 1}),
         "s2_lock_free": (2, {"lock_free_update": True, "offload_optimizer": {"device": "cpu"}}),
         "s3_fp16_overflow": (3, {"precision": "fp16", "overflow_step": 1}),
         "s3_bf16_print": (3, {"precision": "bf16", "steps_per_print": 2})}


def _all_cases(rank, world_size):
    out = {}
    for name, (stage, kw) in CASES.items():
        kw = dict(kw)
        zero = {} if kw.pop("reuse", False) else NO_REUSE
        out[name] = _run(rank, world_size, stage, **kw, **zero)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_cases, DP, timeout=240)


def test_stage3_matches_theory_exactly(runs):
    """3 partitioned chunks x 2 passes x 2 micro-batches + 1 resident refresh = 13 all-gathers; every chunk's
    gradient reduce-scattered per micro-batch, except fc1's (512 elements, the last to complete in backward):
    its buffer is held across the micro-batch boundary and reduced once = 7; fp32."""
    r = runs[0]["s3"]
    assert r["plans"] == [(False, 512), (True, RES), (False, 1024), (False, 512)]
    for step, (stats, skipped) in enumerate(r["stats"]):
        assert not skipped
        assert _counts_bytes(stats, "all_gather") == (13, (4 * PART + RES) * 4)
        assert _counts_bytes(stats, "reduce_scatter") == (7, (2 * (PART + RES) - 512) * 4)
        assert _counts_bytes(stats, "all_reduce") == (1, 16)
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert stats.measured[kind].nbytes == stats.theory[kind].nbytes
            assert stats.measured[kind].count == stats.theory[kind].count
            assert stats.bytes_vs_theory(kind) == 1.0
            assert stats.measured[kind].seconds > 0
            assert 0 < stats.measured[kind].wait_seconds <= stats.measured[kind].seconds
        # Start-up broadcasts the initial fp32 values of every chunk: they land in the first step.
        assert _counts_bytes(stats, "broadcast") == ((4, (PART + RES) * 4) if step == 0 else (0, 0))
        assert stats.theory["broadcast"] == CollectiveTotals() and stats.bytes_vs_theory("broadcast") is None
    assert runs[1]["s3"]["stats"][1][0].measured["all_gather"].nbytes == r["stats"][1][0].measured["all_gather"].nbytes


def test_stage3_gradient_accumulation_doubles_the_per_micro_batch_bytes_but_the_held_chunk(runs):
    one, two = runs[0]["s3_gas1"]["stats"][1][0], runs[0]["s3"]["stats"][1][0]
    assert _counts_bytes(one, "reduce_scatter") == (4, (PART + RES) * 4)
    assert two.measured["reduce_scatter"].nbytes == 2 * one.measured["reduce_scatter"].nbytes - 512 * 4
    refresh = RES * 4  # the resident chunk is gathered once per step, not per micro-batch
    assert _counts_bytes(one, "all_gather") == (7, 2 * PART * 4 + refresh)
    assert two.measured["all_gather"].nbytes - refresh == 2 * (one.measured["all_gather"].nbytes - refresh)
    assert one.bytes_vs_theory("all_gather") == one.bytes_vs_theory("reduce_scatter") == 1.0


def test_reuse_rule_shows_as_fewer_gathers_than_theory(runs):
    """stage3_max_reuse_distance 0 keeps a chunk whose very next request is itself (from the first step, by
    the trace predicted from the module order): fc3.weight between each micro-batch's forward and backward,
    fc1.weight across the micro-batch boundary: 3 gathers of 512 elements fewer."""
    stats = [s for s, _ in runs[0]["s3_reuse"]["stats"]]
    for s in stats:
        assert s.measured["all_gather"].count == 13 - 3
        assert s.measured["all_gather"].nbytes == s.theory["all_gather"].nbytes - 3 * 512 * 4
        assert s.bytes_vs_theory("all_gather") < 1.0
        assert s.bytes_vs_theory("reduce_scatter") == 1.0


def test_stage2_and_stage1(runs):
    """Stage 2: every chunk resident (3 chunks: 544, 1056, 560), gradients reduce-scattered per micro-batch
    in the compute dtype, but the 544-element chunk's (the last to complete: held and reduced once); stage 1:
    summed over micro-batches in fp32 and reduce-scattered once per step. Both re-gather the updated
    parameters once per step."""
    for name, rs_count, rs_bytes in (("s2", 5, (2 * 2160 - 544) * 4), ("s2_gas1", 3, 2160 * 4),
                                     ("s1", 3, 2160 * 4), ("s1_gas1", 3, 2160 * 4)):
        r = runs[0][name]
        assert r["plans"] == [(True, 544), (True, 1056), (True, 560)]
        for stats, _ in r["stats"]:
            assert _counts_bytes(stats, "reduce_scatter") == (rs_count, rs_bytes), name
            assert _counts_bytes(stats, "all_gather") == (3, 2160 * 4), name
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                assert stats.bytes_vs_theory(kind) == 1.0, (name, kind)
                assert stats.measured[kind].count == stats.theory[kind].count, (name, kind)


def test_lock_free_update_regathers_from_the_second_step(runs):
    """The update of step t is published (and its parameters gathered) at step t+1."""
    stats = [s for s, _ in runs[0]["s2_lock_free"]["stats"]]
    assert [s.measured["all_gather"].count for s in stats] == [0, 3, 3]
    assert [s.theory["all_gather"].count for s in stats] == [0, 3, 3]
    assert stats[0].bytes_vs_theory("all_gather") is None and stats[1].bytes_vs_theory("all_gather") == 1.0


def test_skipped_step_does_not_regather_and_bf16_halves_the_bytes(runs):
    fp16 = runs[0]["s3_fp16_overflow"]["stats"]
    assert [skipped for _, skipped in fp16] == [False, True, False]
    ok, bad = fp16[0][0], fp16[1][0]
    assert ok.measured["all_gather"].count == 13 and bad.measured["all_gather"].count == 12
    assert ok.measured["all_gather"].nbytes == (4 * PART + RES) * 2
    assert bad.measured["all_gather"].nbytes == bad.theory["all_gather"].nbytes == 4 * PART * 2
    assert bad.measured["reduce_scatter"].nbytes == 2 * (PART + RES) * 2
    bf16 = runs[0]["s3_bf16_print"]["stats"][2][0]
    assert _counts_bytes(bf16, "reduce_scatter") == (8, 2 * (PART + RES) * 2)
    assert bf16.bytes_vs_theory("all_gather") == 1.0


def test_log_line_every_steps_per_print_and_on_overflow(runs):
    printed = runs[0]["s3_bf16_print"]["messages"]  # steps_per_print 2, 3 steps: only step 2
    assert len(printed) == 1 and printed[0].startswith("zero_cache comm step 2: all_gather: 13 calls, ")
    assert "(1.00x theory)" in printed[0] and "reduce_scatter: 8 calls, 0.01 MiB (1.00x theory)" in printed[0]
    assert "broadcast" not in printed[0]
    overflow = runs[0]["s3_fp16_overflow"]["messages"]  # default steps_per_print 10: the overflow only
    assert len(overflow) == 1 and overflow[0].startswith("zero_cache comm step 1: all_gather: 12 calls")


def test_profiling_off_and_single_process():
    engine = zero_cache.initialize(model=Chain(), config=ds_config(3, 1))
    engine.backward(engine(torch.randn(4, WIDTH)))
    engine.step()
    assert engine.last_comm_stats is None and engine.profiler.events == []
    engine = zero_cache.initialize(model=Chain(), config=ds_config(3, 1, is_communication_time_profiling=True))
    engine.backward(engine(torch.randn(4, WIDTH)))
    engine.step()
    stats = engine.last_comm_stats  # no peer: nothing is communicated, in practice or in theory
    assert all(stats.measured[k] == stats.theory[k] == CollectiveTotals() for k in COLLECTIVES)
    assert stats.line() == "no collectives"


def test_theory_rejects_bad_input():
    plans = [ChunkPlan(0, 0, False, numel=10, padded=10, shard=5)]
    assert zero_step_theory(plans, stage=3, element_size=2, dp_size=2, micro_batches=3,
                            param_updates=1)["all_gather"] == CollectiveTotals(6, 120)
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3, got 4"):
        zero_step_theory(plans, stage=4, element_size=2, dp_size=2, micro_batches=1, param_updates=1)
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        zero_step_theory(plans, stage=3, element_size=2, dp_size=2, micro_batches=0, param_updates=1)
