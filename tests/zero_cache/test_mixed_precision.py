"""fp16 dynamic loss scaling (overflow -> skip + lower scale -> recover) and bf16 training, stage 3, DP=2."""
from __future__ import annotations

import pytest
import torch

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import batches, ds_config, make_model, rank_micro_batches, reference_run

pytestmark = pytest.mark.multiprocess

DP, STEPS, BAD_STEP = 2, 8, 2


def _train(rank, world_size, precision):
    config = ds_config(3, world_size)
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1,
                          "loss_scale_window": 1000}
    else:
        config["bf16"] = {"enabled": True}
    model = make_model()
    engine = zero_cache.initialize(model=model, config=config)
    engine.register_external_parameter(model.head, model.embed.weight)
    data = batches(STEPS)
    rows = []
    for s in range(STEPS):
        before = engine.gather_state_dict()
        losses = []
        for i, mb in enumerate(rank_micro_batches(data[s], rank, world_size)):
            loss = engine(mb)
            losses.append(loss.item())
            if precision == "fp16" and s == BAD_STEP and rank == 0 and i == 0:
                loss = loss * float("inf")  # only one rank overflows: the flag must reach every rank
            engine.backward(loss)
        result = engine.step()
        after = engine.gather_state_dict()
        unchanged = rank != 0 or all(torch.equal(before[k], after[k]) for k in before)
        rows.append((sum(losses) / len(losses), result.skipped, result.loss_scale, engine.loss_scale, unchanged))
    dtypes = {p.dtype for p in model.parameters()}
    return rows, [str(d) for d in dtypes]


def test_fp16_overflow_skips_step_lowers_scale_and_recovers():
    results = run_distributed(_train, DP, "fp16", timeout=180)
    for rows, dtypes in results:
        assert dtypes == ["torch.float16"]
        skipped = [s for s, row in enumerate(rows) if row[1]]
        assert skipped == [BAD_STEP]
        _, _, scale_used, scale_after, unchanged = rows[BAD_STEP]
        assert scale_used == 256.0 and scale_after == 128.0 and unchanged
        assert rows[BAD_STEP + 1][2] == 128.0 and not rows[BAD_STEP + 1][1]
    rank0_rows = results[0][0]
    assert not any(row[4] for s, row in enumerate(rank0_rows) if s != BAD_STEP)  # other steps do update
    losses = [sum(r[0][s][0] for r in results) / DP for s in range(STEPS)]
    assert losses[-1] < losses[0] - 1.0  # training recovered and kept going


def test_bf16_trains_close_to_fp32():
    results = run_distributed(_train, DP, "bf16", timeout=180)
    assert results[0][1] == ["torch.bfloat16"]
    losses = [sum(r[0][s][0] for r in results) / DP for s in range(STEPS)]
    ref, _ = reference_run(steps=STEPS)
    assert not any(row[1] for r in results for row in r[0])
    assert losses[-1] < losses[0] - 1.0
    for a, b in zip(losses, ref):
        assert abs(a - b) < 0.05 * b, (losses, ref)
