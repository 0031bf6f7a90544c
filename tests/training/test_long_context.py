"""Sequence and context parallelism train exactly like one process (fp32, dropout off, causal attention with
RoPE and grouped query heads): 10 steps of losses and the final weights within 1e-5, with Megatron DDP and with
ZeRO-3 whose parameters and optimizer states live in host memory.

The sequence (32 tokens) is split into 2 x CP chunks of 8 with context parallelism, and each rank's part again
into TP pieces with sequence parallelism, so every boundary the splits make (chunk edges inside a rank, the ring
hops, the all-to-all between heads and sequence, the gathered keys and values, the sequence-parallel gathers) lies
inside the causal window.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.training.parallel_harness import (
    LLAMA_STYLE,
    TINY_GPT,
    check_matches_reference,
    ds_config_flags,
    reference,
    train,
)

pytestmark = pytest.mark.multiprocess

LONG = LLAMA_STYLE + ["--seq-length", "32", "--max-position-embeddings", "32"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]

SPLITS = {
    "tp2-sp": (TP2_SP, 2),
    "cp2-p2p": (["--context-parallel-size", "2", "--cp-comm-type", "p2p"], 2),
    "cp2-a2a": (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 2),
    "cp2-allgather": (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], 2),
    "cp2-tp2-sp-dp2": (["--context-parallel-size", "2"] + TP2_SP, 8),
}


@pytest.mark.parametrize("engine", ["ddp", "zero3-offload"])
@pytest.mark.parametrize("split", SPLITS)
def test_split_sequence_matches_single_process(split, engine, tmp_path):
    flags, world = SPLITS[split]
    if engine == "zero3-offload":
        flags = flags + ds_config_flags(tmp_path, 3, offload=True)
    check_matches_reference(LONG, flags, world)


def test_sequence_parallel_gpt2_style():
    """Learned positions (scattered over the sequence), LayerNorm with biases, biased row-parallel outputs and
    a tied output head: each of their gradients is summed over the tensor-parallel ranks."""
    check_matches_reference(["--seq-length", "32", "--max-position-embeddings", "32"], TP2_SP, 2)


def test_selective_recompute_is_bit_identical():
    """Recomputing the attention core in backward changes nothing, alone and under ring attention."""
    plain_losses, plain_params, _ = reference(tuple(LONG))
    losses, params, _ = train(TINY_GPT + LONG + ["--recompute-granularity", "selective"], 1)
    assert losses == plain_losses
    for name, ref in plain_params.items():
        assert params[name].equal(ref), name
    cp = ["--context-parallel-size", "2", "--recompute-granularity", "selective"]
    check_matches_reference(LONG, cp, 2)


def test_resume_across_sequence_splits(tmp_path):
    """Saved at iteration 5 by CP2 x TP2 with sequence parallelism under ZeRO-3, resumed by the all-to-all
    variant on CP2 and by one process: steps 6-10 and the final weights equal the uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    ref_losses, ref_params, _ = reference(tuple(LONG))
    first, _, _ = train(TINY_GPT + LONG + ["--context-parallel-size", "2"] + TP2_SP + ds_config_flags(tmp_path, 3)
                        + ["--save", ckpt, "--save-interval", "5", "--exit-interval", "5"], 4)
    assert sorted(first) == [1, 2, 3, 4, 5]
    for name, (flags, world) in {"cp2-a2a": (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 2),
                                 "one process": ([], 1)}.items():
        losses, params, _ = train(TINY_GPT + LONG + flags + ["--load", ckpt], world)
        assert sorted(losses) == [6, 7, 8, 9, 10], name
        for it in range(6, 11):
            assert losses[it] == pytest.approx(ref_losses[it], rel=1e-5), f"{name}: iteration {it}"
        for key, ref in ref_params.items():
            torch.testing.assert_close(params[key], ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, key=key, name=name: f"{name} {key}: {m}")


def _emulated_zero3(tmp_path) -> list[str]:
    """ZeRO-3 with states in host memory behind the emulated accelerator: copies run on their own threads with
    random delays and their destinations hold NaN until they land, so a missing wait shows in the numbers."""
    zero = {"stage": 3, "allgather_bucket_size": 30000, "stage3_param_persistence_threshold": 64,
            "sub_group_size": 50000, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
            "emulated_accelerator": {"enabled": True, "h2d_gbps": 0.5, "d2h_gbps": 0.5, "random_delay_ms": 1.0}}
    path = tmp_path / "ds_emulated.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return ["--deepspeed", "--deepspeed_config", str(path)]


def test_activation_offload_is_bit_identical(tmp_path):
    """--cpu-offloading on the emulated accelerator, on one process and through 1F1B on two stages (several
    micro-batches' activations in host memory at once): the same losses and weights, bit for bit, and every
    step moved activations to host memory. Tensors under 64 KiB stay put: this model's are 128 KiB and more."""
    wide = LONG[:LONG.index("--seq-length")] + ["--hidden-size", "128", "--seq-length", "128",
                                                  "--max-position-embeddings", "128", "--log-interval", "1"]
    for mesh, world in (([], 1), (["--pipeline-model-parallel-size", "2"], 2)):
        flags = TINY_GPT + wide + mesh + _emulated_zero3(tmp_path)
        plain_losses, plain_params, _ = train(flags, world)
        losses, params, outs = train(flags + ["--cpu-offloading", "--cpu-offloading-num-layers", "1"], world)
        assert losses == plain_losses, mesh
        for name, ref in plain_params.items():
            assert params[name].equal(ref), (mesh, name)
        for o in outs:  # every stage moved activations in every step
            assert sorted(o["offloaded"]) == list(range(1, 11)) and min(o["offloaded"].values()) > 0, mesh
