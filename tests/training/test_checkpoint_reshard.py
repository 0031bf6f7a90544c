"""A checkpoint saved by one mesh and ZeRO placement resumes on others: steps 6-10 equal the uninterrupted run.

ZeRO-3 on TP2 x PP2 x DP2 with every state on SSD saves at iteration 5; plain data parallelism on TP1 x PP2 x
DP2, ZeRO-1 with the optimizer in host memory on TP2 x PP1 x DP2, and ZeRO-3 on DP4 with other page and
sub-group sizes load it. The reference is the single-process run (the meshes equal it within 1e-5: see
test_parallel_equivalence.py), losses and final weights.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.training.parallel_harness import TINY_GPT, ds_config_flags, reference, train

pytestmark = pytest.mark.multiprocess

TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _ds(tmp_path, name: str, zero: dict) -> list[str]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return ["--deepspeed", "--deepspeed_config", str(path)]


def test_resume_on_other_meshes_and_placements(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ref_losses, ref_params, _ = reference(())
    first, _, _ = train(TINY_GPT + TP2PP2 + ds_config_flags(tmp_path, 3, nvme=True)
                        + ["--save", ckpt, "--save-interval", "5", "--exit-interval", "5"], 8)
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "5"
    targets = {
        "ddp-tp1pp2dp2": (["--pipeline-model-parallel-size", "2"], 4),
        "zero1-host-tp2pp1dp2": (["--tensor-model-parallel-size", "2"] + _ds(tmp_path, "zero1", {
            "stage": 1, "allgather_bucket_size": 2500, "offload_optimizer": {"device": "cpu"}}), 4),
        "zero3-host-dp4-other-pages": (_ds(tmp_path, "zero3", {
            "stage": 3, "allgather_bucket_size": 1700, "stage3_param_persistence_threshold": 200,
            "sub_group_size": 900, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}), 4),
    }
    for name, (flags, world) in targets.items():
        losses, params, _ = train(TINY_GPT + flags + ["--load", ckpt], world)
        assert sorted(losses) == [6, 7, 8, 9, 10], name
        for it in range(6, 11):
            assert losses[it] == pytest.approx(ref_losses[it], rel=1e-5), f"{name}: iteration {it}"
        assert params.keys() == ref_params.keys()
        for key, ref in ref_params.items():
            torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
