"""``--compile``: torch.compile each dense transformer layer (torchtitan's per-block compile).

Each layer's ``forward`` is replaced by its compiled version on the instance, so the module's hooks still run
eagerly around it: the ZeRO-3 engine gathers a compiled layer's parameters before it runs and releases them after,
with the layer marked as one unit (``zero_cache.set_z3_leaf_module``), so nothing inside it is hooked. The
layers return their weight gradients through autograd (the parser turns gradient-accumulation fusion off), which
the engine's gradient hooks take outside the compiled graphs. Mixture-of-experts layers stay eager (the tokens
each expert gets change every step). Every layer runs the same code on parameters of the same shapes, so one
graph serves them all: after the first step nothing recompiles.

Without tensor or context parallelism and without attention dropout a layer compiles into one graph
(``tests/training/test_compile.py`` checks it has no break). The tensor-parallel collectives (autograd functions
around torch.distributed calls), the context-parallel attention and the per-rank RNG streams of attention dropout
split it: dynamo runs those parts eagerly between the compiled pieces. Compiled dropout draws its masks from
inductor's generator, so a run with dropout does not repeat an eager run's masks.
"""
from __future__ import annotations

import torch
from torch import nn

import zero_cache
from megatron.model.transformer import TransformerLayer


def compile_blocks(model: nn.Module) -> list[TransformerLayer]:
    """Compile every dense ``TransformerLayer`` of ``model`` in place; returns them."""
    compiled = []
    for layer in model.modules():
        if isinstance(layer, TransformerLayer) and not layer.is_moe:
            layer.forward = torch.compile(layer.forward)
            zero_cache.set_z3_leaf_module(layer)
            compiled.append(layer)
    return compiled
