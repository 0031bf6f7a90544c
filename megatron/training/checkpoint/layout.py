"""Where each of this rank's parameters lies in the model's mesh-independent global tensors.

A global tensor is the parameter of the same model built on one process (TP = PP = 1): layer indices are
global, tensor-parallel slices are joined along their partition dimension, and the last pipeline stage's copy
of a tied word embedding is the embedding itself; an MoE layer's stacked expert weights hold every expert
(expert-parallel ranks hold consecutive blocks of dimension 0). A tensor replicated across tensor-parallel ranks
is stored by tp rank 0; the tied copy is stored by the first stage. The word embedding and the output layer may differ
in their padded vocabulary along dimension 0 (``--make-vocab-size-divisible-by`` x TP).

Under the interleaved schedule a stage's model is a ``ModelChunks`` and its local names start with
``chunks.<k>.``; each chunk's layer indices are made global with that chunk's own ``layer_offset``, so a
checkpoint saved with virtual pipeline stages loads into a run without them and the other way round.
"""
from __future__ import annotations

import re

import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel.model_chunks import chunk_of, named_chunks
from megatron.model.gpt_model import WORD_EMBEDDING
from zero_cache.checkpoint.geometry import GlobalSlice

OUTPUT_LAYER = "output_layer.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_VOCAB_PARALLEL = (WORD_EMBEDDING, OUTPUT_LAYER)


def global_name(name: str, layer_offset: int) -> str:
    """A stage-local parameter name with its layer index made global."""
    m = _LAYER.match(name)
    return f"decoder.layers.{layer_offset + int(m.group(1))}.{m.group(2)}" if m else name


def model_layout(model: torch.nn.Module) -> dict[str, GlobalSlice]:
    """{local parameter name: its place} for this rank's ``model`` (a GPTModel pipeline stage, or the
    ``ModelChunks`` of one under the interleaved schedule)."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    out = {}
    for prefix, chunk in named_chunks(model):
        for name, p in chunk.named_parameters():
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
            gname = WORD_EMBEDDING if shared else global_name(name, chunk.layer_offset)
            writes = not shared and (partitioned or tp_rank == 0)
            out[prefix + name] = GlobalSlice(gname, tuple(gshape), tuple(offsets), writes,
                                             resizable_dim=0 if gname in _VOCAB_PARALLEL else None)
    return out


def layout_function(model: torch.nn.Module):
    """``model_layout`` as the (name, shape) -> GlobalSlice function the checkpoint code takes."""
    places = model_layout(model)

    def layout(name: str, shape: tuple[int, ...]) -> GlobalSlice:
        place = places.get(name)
        if place is None:  # a buffer (a router's expert bias): replicated over TP, stored by tp rank 0
            chunk, local = chunk_of(model, name)
            return GlobalSlice(global_name(local, chunk.layer_offset), shape, (0,) * len(shape),
                               ps.get_tensor_model_parallel_rank() == 0)
        return place
    return layout
