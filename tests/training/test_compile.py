"""``--compile``: every dense transformer layer compiled (megatron/training/compile.py).

Trained under ZeRO-3 on two ranks with full recompute and under TP2 with sequence parallelism, each equal to the
eager single-process run within 1e-5 (losses and final weights); nothing recompiles after the first step; a layer
compiles into one graph (``torch._dynamo.explain``); what a compiled layer cannot hold is refused in one line.
"""
from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.config import ConfigError
from tests.training.parallel_harness import (
    TINY_GPT,
    _train_rank,
    assert_same_training,
    ds_config_flags,
    reference,
    train,
)


def _counted_rank(rank: int, world: int, argv: list[str]) -> dict:
    """``_train_rank``, also recording dynamo's count of distinct graphs after every step."""
    from torch._dynamo.utils import counters

    from megatron.training import training

    train_step, graphs = training.train_step, []

    def counted(*args, **kwargs):
        out = train_step(*args, **kwargs)
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    training.train_step = counted
    out = _train_rank(rank, world, argv)
    out["graphs"] = graphs
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["zero3-dp2-recompute", "tp2-sp"])
def test_compiled_layers_train_as_eager(run, tmp_path):
    mesh = {"zero3-dp2-recompute": ds_config_flags(tmp_path, 3) + ["--recompute-granularity", "full"],
            "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}[run]
    ref_losses, ref_params, _ = reference(())
    losses, params, outs = train(TINY_GPT + ["--compile"] + mesh, 2, rank_fn=_counted_rank)
    assert_same_training(losses, params, ref_losses, ref_params, what=run)
    for o in outs:  # graphs compiled in the first step, none after
        assert o["graphs"][0] > 0 and o["graphs"][1:] == [o["graphs"][0]] * 9, o["graphs"]


def test_a_layer_compiles_into_one_graph(single_rank):
    from megatron.model.transformer import TransformerLayer

    cfg = parse_args(TINY_GPT + ["--compile"], world_size=1)
    layer = TransformerLayer(cfg.model.transformer_config(100, 1), 0, None)
    x = torch.randn(2, 16, 32, requires_grad=True)
    explained = torch._dynamo.explain(layer.forward)(x, None, None)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_what_a_compiled_layer_cannot_hold_is_refused():
    base = TINY_GPT + ["--compile"]
    for extra, match in ((["--cpu-offloading"], "--cpu-offloading"),
                         (["--recompute-granularity", "selective"], "selective"),
                         (["--pipeline-model-parallel-size", "2", "--enable-zero-bubble",
                           "--use-distributed-optimizer"], "zb-h1")):
        with pytest.raises(ConfigError, match=match):
            parse_args(base + extra, world_size=2)
    assert not parse_args(base, world_size=1).model.gradient_accumulation_fusion
