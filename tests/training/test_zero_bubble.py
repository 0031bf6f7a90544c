"""The zero-bubble ZB-H1 schedule end to end: each backward split into its input-gradient pass and its weight pass,
the weight passes run later, while the round's exchange is in flight.

Training equals the single-process run within 1e-5 (losses and final weights): PP2 x DP2 with ZeRO-3 and every
state on the SSD tier, and TP2 x PP2 with sequence parallelism and ZeRO-1, both with a steady phase (4
micro-batches per step and data-parallel rank). The engine is told which pass is the step's last, so its weight
pass, not an input-gradient pass, makes the gradients final.
"""
from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.zero_bubble import ZeroBubbleH1Schedule
from megatron.training.arguments import parse_args
from megatron.training.config import ConfigError
from tests.core.test_interleaved_schedule import simulate
from tests.training.parallel_harness import (
    TINY_GPT,
    _train_rank,
    assert_same_training,
    ds_config_flags,
    reference,
    train,
)

ZB = ["--pipeline-model-parallel-size", "2", "--enable-zero-bubble", "--micro-batch-size", "1"]


def _counted_rank(rank: int, world: int, argv: list[str]) -> dict:
    """``_train_rank``, also counting the weight gradients each weight pass wrote and the passes the engine was
    told were the step's last."""
    from zero_cache.engine import ZeroEngine

    backward_weights, boundary = ZeroEngine.backward_weights, ZeroEngine.set_gradient_accumulation_boundary
    writes, last = [], []

    def counted(self, kept):
        writes.append(len(kept))
        backward_weights(self, kept)

    def told(self, is_boundary):
        last.append(is_boundary)
        boundary(self, is_boundary)

    ZeroEngine.backward_weights, ZeroEngine.set_gradient_accumulation_boundary = counted, told
    out = _train_rank(rank, world, argv)
    out.update(writes=writes, last=last)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["zero3-ssd-pp2dp2", "zero1-tp2pp2-sp"])
def test_zb_h1_matches_single_process(run, tmp_path):
    mesh = {
        "zero3-ssd-pp2dp2": ZB + ds_config_flags(tmp_path, 3, nvme=True),
        "zero1-tp2pp2-sp": ZB + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--global-batch-size", "4", "--use-distributed-optimizer"],
    }[run]
    extra = ["--micro-batch-size", "1"] + (["--global-batch-size", "4"] if "tp2" in run else [])
    ref_losses, ref_params, _ = reference(tuple(extra))
    losses, params, outs = train(TINY_GPT + extra + mesh, 4, rank_fn=_counted_rank)
    assert_same_training(losses, params, ref_losses, ref_params)
    m = 4  # micro-batches per step and data-parallel rank
    for o in outs:  # 10 steps of m weight passes, each with the weights of its stage's 2 layers' 4 linears
        assert len(o["writes"]) == 10 * m and min(o["writes"]) >= 8, o["writes"]
        # per step: m input-gradient passes and m - 1 weight passes that are not the last, then the last
        assert o["last"] == ([False] * (2 * m - 1) + [True]) * 10, o["last"]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_zb_h1_rounds_keep_1f1b_order_and_run_every_weight_pass_once(p, m):
    """On simulated pipelines: the forwards and input-gradient passes come in 1F1B's order (so every exchange is
    1F1B's); each micro-batch's weight pass runs once, after its B; a rank never holds more than p micro-batches
    (forward done, weight pass not), the first stage's peak under 1F1B, and rank r at most max(r, 1) + 1 weight
    passes pending; the step ends with the last micro-batch's weight pass."""
    events = simulate(p, 1, m, schedule=lambda p, r, v, m: ZeroBubbleH1Schedule(p, r, m))
    for r, ev in enumerate(events):
        w = min(p - r - 1, m)
        order = [("F", 0, k) for k in range(w)]
        for k in range(m - w):
            order += [("F", 0, w + k), ("B", 0, k)]
        order += [("B", 0, k) for k in range(m - w, m)]
        assert [e for e in ev if e[0] != "W"] == order, (r, ev)
        weights = [e for e in ev if e[0] == "W"]
        assert weights == [("W", 0, k) for k in range(m)] and ev[-1] == ("W", 0, m - 1)
        held = pending = held_peak = pending_peak = 0
        for e in ev:
            held += {"F": 1, "W": -1}.get(e[0], 0)
            pending += {"B": 1, "W": -1}.get(e[0], 0)
            held_peak, pending_peak = max(held_peak, held), max(pending_peak, pending)
        assert held_peak <= min(p, m) and pending_peak <= max(r, 1) + 1, (r, ev)


def test_zb_h1_flags_are_checked(tmp_path):
    base = TINY_GPT + ["--micro-batch-size", "1"]
    with pytest.raises(ConfigError, match="zero_cache engine"):
        parse_args(base + ZB, world_size=2)
    with pytest.raises(ConfigError, match="--no-gradient-accumulation-fusion"):
        parse_args(base + ZB + ["--use-distributed-optimizer", "--no-gradient-accumulation-fusion"], world_size=2)
    with pytest.raises(ConfigError, match="pipeline-model-parallel-size > 1"):
        parse_args(base + ["--enable-zero-bubble", "--use-distributed-optimizer"], world_size=1)
    with pytest.raises(ConfigError, match="keep one"):
        parse_args(base + ZB + ["--pipeline-schedule", "1f1b"], world_size=2)
    with pytest.raises(ConfigError, match="one model chunk per stage"):
        parse_args(base + ZB + ["--use-distributed-optimizer", "--virtual-pipeline-model-parallel-size", "2"],
                   world_size=2)
    cfg = parse_args(base + ZB + ["--use-distributed-optimizer"], world_size=2)
    assert cfg.parallel.pipeline_schedule == "zb-h1"
    assert parse_args(base + ["--pipeline-model-parallel-size", "2"], world_size=2).parallel.pipeline_schedule == "1f1b"
