"""benchmarks/planner_validation.py without running anything: every configuration is one the planner predicts and
the trainer accepts (with the ZeRO config the planner writes), and the group ranking reads right."""
from __future__ import annotations

import dataclasses
import json

from benchmarks import planner_validation as pv
from megatron.training.arguments.parse import parse_args
from ptm_planner.measure import local_speeds
from ptm_planner.profiles import PROFILES
from ptm_planner.step_model import StepPrediction, Term

# A stand-in for this machine's measured profile: figures of the order measure.py finds, nothing measured.
LOCAL = dataclasses.replace(PROFILES["a100-eth"], name="local", gpus_per_node=2, overlaps_comm=False,
                            accelerator=dataclasses.replace(PROFILES["a100-eth"].accelerator, peak_tflops=0.08,
                                                            gemm_efficiency=1.0, memory_gbps=16.0))


def test_every_configuration_is_predicted_and_accepted_by_the_trainer(tmp_path):
    for c in pv.CONFIGS:
        pred, config = pv.plan(c, LOCAL, local_speeds(LOCAL), host_s=0.1)
        assert pred.step_s > 0.1 and pred.micro_batches == c.micro_batches
        assert pred.tokens == pv.GLOBAL_BATCH * 256
        path = None
        if config is not None:
            path = tmp_path / f"{c.name}.json"
            path.write_text(json.dumps(config))
        par = parse_args(pv.trainer_argv(c, 3, str(path) if path else None), world_size=pv.RANKS).parallel
        # The trainer splits the 2 ranks as the configuration says, with the model's micro-batches per step.
        assert par.data_parallel_size == c.replicas
        assert par.global_batch_size // (par.micro_batch_size * par.data_parallel_size) == c.micro_batches


def _row(name: str, groups: tuple[str, ...], predicted: float, measured: float) -> pv.Row:
    pred = StepPrediction([Term("GEMMs", predicted)], [], 1, 0.0, 1, 1, 1.0, 1.0, 0.1)
    return pv.Row(pv.Config(name, groups=groups), pred, measured)


def test_groups_compare_the_predicted_order_with_the_measured_one():
    rows = [_row("a", ("g",), 1.0, 1.1), _row("b", ("g",), 2.0, 1.0), _row("c", ("h",), 1.0, 1.0),
            _row("d", ("h",), 2.0, 2.0)]
    lines, all_right = pv.ranking_lines(rows)
    assert not all_right
    assert lines[0] == "| g | a < b | b < a | NO | a: +10.0% |"
    assert lines[1] == "| h | c < d | c < d | yes | c: +0.0% |"
