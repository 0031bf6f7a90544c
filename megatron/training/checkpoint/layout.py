"""Where each of this rank's parameters lies in the model's mesh-independent global tensors.

A global tensor is the parameter of the same model built on one process (TP = PP = 1): layer indices are
global, tensor-parallel slices are joined along their partition dimension, and the last pipeline stage's copy
of a tied word embedding is the embedding itself; an MoE layer's stacked expert weights hold every expert
(expert-parallel ranks hold consecutive blocks of dimension 0). A tensor replicated across tensor-parallel ranks
is stored by tp rank 0; the tied copy is stored by the first stage. The word embedding and the output layer may differ
in their padded vocabulary along dimension 0 (``--make-vocab-size-divisible-by`` x TP).
"""
from __future__ import annotations

import re

import torch

from megatron.core import parallel_state as ps
from megatron.model.gpt_model import WORD_EMBEDDING, stage_layers
from zero_cache.checkpoint.geometry import GlobalSlice

OUTPUT_LAYER = "output_layer.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_VOCAB_PARALLEL = (WORD_EMBEDDING, OUTPUT_LAYER)


def global_name(name: str, layer_offset: int) -> str:
    """A stage-local parameter name with its layer index made global."""
    m = _LAYER.match(name)
    return f"decoder.layers.{layer_offset + int(m.group(1))}.{m.group(2)}" if m else name


def model_layout(model: torch.nn.Module) -> dict[str, GlobalSlice]:
    """{local parameter name: its place} for this rank's ``model`` (a GPTModel pipeline stage)."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    offset, _ = stage_layers(model.config.num_layers, ps.get_pipeline_model_parallel_world_size(),
                             ps.get_pipeline_model_parallel_rank())
    out = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        gshape, offsets = list(shape), [0] * len(shape)
        partitioned = getattr(p, "tensor_model_parallel", False)
        if partitioned:
            d = p.partition_dim
            gshape[d] *= tp
            offsets[d] = tp_rank * shape[d]
        expert_dim = getattr(p, "expert_partition_dim", None)
        if expert_dim is not None:
            gshape[expert_dim] *= ep
            offsets[expert_dim] = ep_rank * shape[expert_dim]
        shared = getattr(p, "shared", False)  # the last stage's copy of the tied word embedding
        gname = WORD_EMBEDDING if shared else global_name(name, offset)
        writes = not shared and (partitioned or tp_rank == 0)
        out[name] = GlobalSlice(gname, tuple(gshape), tuple(offsets), writes,
                                resizable_dim=0 if gname in _VOCAB_PARALLEL else None)
    return out


def layout_function(model: torch.nn.Module):
    """``model_layout`` as the (name, shape) -> GlobalSlice function the checkpoint code takes."""
    places = model_layout(model)
    offset, _ = stage_layers(model.config.num_layers, ps.get_pipeline_model_parallel_world_size(),
                             ps.get_pipeline_model_parallel_rank())

    def layout(name: str, shape: tuple[int, ...]) -> GlobalSlice:
        place = places.get(name)
        if place is None:  # a buffer (a router's expert bias): replicated over TP, stored by tp rank 0
            return GlobalSlice(global_name(name, offset), shape, (0,) * len(shape),
                               ps.get_tensor_model_parallel_rank() == 0)
        return place
    return layout
