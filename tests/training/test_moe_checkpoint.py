"""Distributed checkpoints of an MoE model reshard the experts to any EP / TP / PP / DP size and memory tier.

The tiny MoE GPT (4 experts, top-2, load-balancing and z-loss, and the aux-loss-free expert bias, a persistent
buffer of every router) saves at iteration 5 on one mesh and resumes on others; steps 6-10 (losses) and the final
weights and expert biases equal the uninterrupted single-process run within 1e-5 (the meshes equal that run:
test_moe_parallel.py). Saved by plain data parallelism on EP2 x PP2 x DP2 (4 ranks), it resumes under ZeRO-3 with
every state on SSD at EP4 and on one process (EP1); saved by ZeRO-3 on EP2 x TP2 (4 ranks), it resumes on
EP1 x PP2 x DP2 data parallelism. The legacy per-rank format has no place for expert shards and is refused.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron.training.arguments import ConfigError, parse_args
from tests.training.parallel_harness import TINY_GPT, assert_same_training, ds_config_flags, reference, train

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001"]
EXPERT_BIAS = MOE + ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]


def _save_at_5(tmp_path, name: str, extra: list[str], flags: list[str], world: int) -> str:
    ckpt = str(tmp_path / name)
    first, _, _ = train(TINY_GPT + extra + flags + ["--save", ckpt, "--save-interval", "5", "--exit-interval", "5"],
                        world)
    assert sorted(first) == [1, 2, 3, 4, 5]
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "5"
    return ckpt


def _resume(ckpt: str, extra: list[str], targets: dict[str, tuple[list[str], int]]) -> None:
    ref_losses, ref_params, _ = reference(tuple(extra))
    for name, (flags, world) in targets.items():
        losses, params, _ = train(TINY_GPT + extra + flags + ["--load", ckpt], world)
        for key in (k for k in ref_params if k.endswith("router.expert_bias")):  # first: the clearest message
            torch.testing.assert_close(params.get(key), ref_params[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
        assert_same_training(losses, params, ref_losses, ref_params, iterations=range(6, 11), what=name)


@pytest.mark.multiprocess
def test_ddp_ep2_pp2_checkpoint_resumes_at_ep4_zero3_ssd_and_ep1(tmp_path):
    ckpt = _save_at_5(tmp_path, "ddp_ep2pp2", MOE, ["--expert-model-parallel-size", "2",
                                                    "--pipeline-model-parallel-size", "2"], 4)
    _resume(ckpt, MOE, {
        "zero3-ssd-ep4dp4": (["--expert-model-parallel-size", "4"] + ds_config_flags(tmp_path, 3, nvme=True), 4),
        "ddp-one-process": ([], 1),
    })


@pytest.mark.multiprocess
def test_zero3_ep2_tp2_checkpoint_resumes_at_ep1_pp2_ddp(tmp_path):
    ckpt = _save_at_5(tmp_path, "zero3_ep2tp2", MOE, ["--expert-model-parallel-size", "2",
                                                      "--tensor-model-parallel-size", "2"]
                      + ds_config_flags(tmp_path, 3, offload=True), 4)
    _resume(ckpt, MOE, {"ddp-ep1pp2dp2": (["--pipeline-model-parallel-size", "2"], 4)})


@pytest.mark.multiprocess
def test_expert_bias_resumes_on_another_pipeline_split(tmp_path):
    """The routers' expert bias (a persistent buffer) is saved with the weights: saved on EP2 x DP2, it resumes
    on one process and on PP2 (layers 2-3 on the second stage, whose local names are decoder.layers.0-1).

    Fails at the time of writing on the PP2 target: megatron/training/checkpoint/layout.py places a buffer
    under its stage-local name (``layout_function``: ``GlobalSlice(name, ...)`` without ``global_name``), so the
    second stage loads layer 0's bias into layer 2 (and a save on PP2 stores layers 2-3's biases under layers
    0-1's names, where a PP1 load finds no 'tensor/decoder.layers.2.mlp.router.expert_bias')."""
    biases = {n: t for n, t in reference(tuple(EXPERT_BIAS))[1].items() if n.endswith("router.expert_bias")}
    assert len(biases) == 4 and all(t.abs().max() > 0 for t in biases.values())  # compared, and not all zero
    ckpt = _save_at_5(tmp_path, "bias_ep2", EXPERT_BIAS, ["--expert-model-parallel-size", "2"], 2)
    _resume(ckpt, EXPERT_BIAS, {"one-process": ([], 1), "pp2": (["--pipeline-model-parallel-size", "2"], 2)})


def test_legacy_checkpoint_format_with_expert_parallelism_is_refused():
    with pytest.raises(ConfigError) as e:
        parse_args(TINY_GPT + MOE + ["--expert-model-parallel-size", "2", "--ckpt-format", "torch"], world_size=2)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("--ckpt-format torch with --expert-model-parallel-size > 1") and "torch_dist" in message
    # EP1 keeps the legacy format available
    assert parse_args(TINY_GPT + MOE + ["--ckpt-format", "torch"], world_size=2).checkpoint.ckpt_format == "torch"
