"""The trainer's comm line and TensorBoard scalars from the engine's communication profiling (--deepspeed)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.training.train_log import TrainLogger
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import TINY_GPT
from zero_cache.comm import COLLECTIVES, CollectiveTotals, CommStepStats

ITERS, LOG_INTERVAL = 4, 2


def _train_rank(rank, world, argv):
    from pretrain_gpt import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = main(argv)
    engine = result.backend.model
    return {"stdout": out.getvalue(), "gas": engine.gradient_accumulation_steps, "stats": engine.last_comm_stats,
            "plans": [(c.plan.resident, c.plan.padded) for c in engine.chunks],
            "held": [engine.chunks[c].plan.padded for c in engine.reducer.keep]}


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.multiprocess
def test_zero3_pretrain_prints_comm_line_and_writes_tensorboard(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "allgather_bucket_size": 3000, "stage3_param_persistence_threshold": 64,
        "sub_group_size": 5000, "is_communication_time_profiling": True}}))
    tb = tmp_path / "tb"
    argv = TINY_GPT + ["--deepspeed", "--deepspeed_config", str(ds), "--tensorboard-dir", str(tb),
                       "--train-iters", str(ITERS), "--log-interval", str(LOG_INTERVAL)]
    first, last = run_distributed(_train_rank, 2, argv, timeout=240)

    # The last rank logs: the comm line right below each iteration line, nothing on the other rank.
    lines = last["stdout"].splitlines()
    comm = [i for i, line in enumerate(lines) if line.startswith(" comm (step ")]
    assert [lines[i].split(",")[0] for i in comm] == [" comm (step 2", " comm (step 4"]
    assert all(lines[i - 1].startswith(" iteration") for i in comm)
    assert "comm (step" not in first["stdout"]
    line = lines[comm[-1]]
    assert " | all_gather: " in line and " | all_reduce: 1 calls, 0.00 MiB (1.00x theory)" in line
    assert "reduce_scatter: " in line and line.split("reduce_scatter: ")[1].split("|")[0].count("(1.00x theory)") == 1

    # Theory from the logging rank's own chunk plans: fp32, stage 3, 2 micro-batches per step; the chunk whose
    # gradients complete last keeps its buffer across the two micro-batches and is reduced once.
    gas, plans, held = last["gas"], last["plans"], last["held"]
    assert gas == 2 and len(held) == 1
    partitioned = sum(n for resident, n in plans if not resident)
    everything = sum(n for _, n in plans)
    scalars = _scalars(tb)
    for kind in COLLECTIVES:
        for name in ("count", "bytes", "seconds", "wait_seconds", "theory_bytes"):
            assert [step for step, _ in scalars[f"comm/{kind}_{name}"]] == [2, 4]
    rs_bytes, rs_count = (gas * everything - (gas - 1) * held[0]) * 4, gas * len(plans) - (gas - 1)
    assert scalars["comm/reduce_scatter_bytes"] == [(2, rs_bytes), (4, rs_bytes)]
    assert scalars["comm/reduce_scatter_count"] == [(2, rs_count), (4, rs_count)]
    assert scalars["comm/reduce_scatter_bytes_vs_theory"] == [(2, 1.0), (4, 1.0)]
    ag_theory = (2 * gas * partitioned + (everything - partitioned)) * 4
    assert scalars["comm/all_gather_theory_bytes"] == [(2, ag_theory), (4, ag_theory)]
    stats = last["stats"]  # the last step is the one logged at iteration 4
    assert scalars["comm/all_gather_bytes"][-1] == (4, stats.measured["all_gather"].nbytes)
    assert scalars["comm/all_gather_bytes_vs_theory"][-1][1] == pytest.approx(stats.bytes_vs_theory("all_gather"))
    assert scalars["comm/all_reduce_count"] == [(2, 1), (4, 1)]
    assert "comm/broadcast_bytes_vs_theory" not in scalars  # no broadcast expected: no ratio written
    assert scalars["comm/all_gather_seconds"][-1][1] > 0


def test_logger_comm_line_and_scalars(tmp_path):
    stats = CommStepStats(
        measured={"all_gather": CollectiveTotals(6, 3 * 2**20, 0.004, 0.001), "reduce_scatter": CollectiveTotals(),
                  "all_reduce": CollectiveTotals(), "broadcast": CollectiveTotals(2, 2**20, 0.002, 0.002)},
        theory={"all_gather": CollectiveTotals(8, 4 * 2**20), "reduce_scatter": CollectiveTotals(),
                "all_reduce": CollectiveTotals(), "broadcast": CollectiveTotals()})
    logger = TrainLogger(train_iters=10, global_batch_size=8, seq_length=16, flops_per_token=1e6, world_size=1,
                         device=torch.device("cpu"), tensorboard_dir=str(tmp_path), is_logging_rank=True)
    logger.record(2.0, False)
    plain = logger.log(5, 40, 1e-3, 1.0, 0.5)
    logger.record(2.0, False)
    text = logger.log(10, 80, 1e-3, 1.0, 0.5, comm=stats)
    logger.close()
    assert "\n" not in plain
    main, comm = text.split("\n")
    assert main.startswith(" iteration       10/      10 |")
    assert comm == (" comm (step 10, data-parallel group) | all_gather: 6 calls, 3.00 MiB (0.75x theory), 4.0 ms, "
                    "1.0 ms waited | broadcast: 2 calls, 1.00 MiB (theory 0), 2.0 ms, 2.0 ms waited |")
    scalars = _scalars(tmp_path)
    assert scalars["comm/all_gather_bytes"] == [(10, 3 * 2**20)]
    assert scalars["comm/all_gather_bytes_vs_theory"] == [(10, 0.75)]
    assert scalars["comm/all_gather_theory_bytes"] == [(10, 4 * 2**20)]
    assert scalars["comm/broadcast_count"] == [(10, 2)]
    assert scalars["comm/all_gather_wait_seconds"][0][1] == pytest.approx(0.001)
    assert "comm/broadcast_bytes_vs_theory" not in scalars and "comm/reduce_scatter_bytes_vs_theory" not in scalars
    assert "lm loss" in scalars and len(scalars["lm loss"]) == 2


def test_logger_moe_fields_and_scalars(tmp_path):
    logger = TrainLogger(train_iters=10, global_batch_size=8, seq_length=16, flops_per_token=1e6, world_size=1,
                         device=torch.device("cpu"), tensorboard_dir=str(tmp_path), is_logging_rank=True)
    logger.record(2.0, False)
    moe = {"load_balancing_loss": 0.0123, "z_loss": 0.00045, "max_load_imbalance": 1.75,
           "min_load_imbalance": 1.05, "load_imbalance/layer0": 1.05, "load_imbalance/layer2": 1.75}
    line = logger.log(5, 40, 1e-3, 1.0, 0.5, moe=moe)
    logger.close()
    assert "| load balancing loss: 1.2300E-02 | z loss: 4.5000E-04 | expert load max/mean: 1.05-1.75 |" in line
    scalars = _scalars(tmp_path)
    assert scalars["moe/load_imbalance/layer2"] == [(5, 1.75)]
    assert scalars["moe/load_balancing_loss"][0][1] == pytest.approx(0.0123)
