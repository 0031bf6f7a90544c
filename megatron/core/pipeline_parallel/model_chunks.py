"""A pipeline stage's model chunks under the interleaved 1F1B schedule, held as one module.

With virtual pipeline stages a stage holds v model chunks spread along the depth of the model: chunk k of stage
r is the (k * PP + r)-th slice of the layers (``megatron.model.gpt_model.stage_layers``). The trainer keeps one
module per stage either way, so the backends wrap it once (DDP, the ZeRO engine) and the checkpoint code reads
one set of parameters: ``ModelChunks`` holds the chunks in a ``ModuleList`` and presents what the trainer uses
of a ``GPTModel``. The schedule picks the chunk that the next call runs with ``select``.

Parameter names gain the chunk's index, ``chunks.<k>.<name inside the chunk>``; ``named_chunks`` and
``chunk_of`` map them back to a chunk (whose ``layer_offset`` makes its layer indices global).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron.core.moe.aux_loss import MoEStats
from megatron.core.moe.layer import MoELayer
from megatron.core.moe.router import TopKRouter

if TYPE_CHECKING:
    from zero_cache.activation_offload import ActivationOffloader

PREFIX = "chunks."


class ModelChunks(nn.Module):
    """The v >= 2 model chunks of one pipeline stage (each a ``GPTModel`` built with ``virtual_stage=k``)."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        if len(chunks) < 2:
            raise ValueError(f"ModelChunks holds the chunks of the interleaved schedule (>= 2), got {len(chunks)}; "
                             "use the model itself for one chunk")
        self.chunks = nn.ModuleList(chunks)
        self.current = 0  # the chunk the next forward runs (set by the schedule)
        self._share_moe_stats()

    def _share_moe_stats(self) -> None:
        """One MoE statistics record for the stage (it is indexed by global layer), so the log line reduces
        one record per rank whatever the number of chunks."""
        stats = self.chunks[0].moe_stats
        if stats is None:
            return
        for chunk in self.chunks[1:]:
            chunk.moe_stats = stats
            for module in chunk.modules():
                if isinstance(module, MoELayer):
                    module.stats = stats

    # ----- which chunk runs -----
    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def select(self, chunk: int) -> None:
        """Make the next forward (and ``set_input_tensor``) go to chunk ``chunk``."""
        if not 0 <= chunk < len(self.chunks):
            raise IndexError(f"model chunk {chunk} of {len(self.chunks)}")
        self.current = chunk

    def forward(self, *args, **kwargs):
        return self.chunks[self.current](*args, **kwargs)

    # ----- what the trainer reads of a GPTModel -----
    @property
    def config(self):
        return self.chunks[0].config

    @property
    def pre_process(self) -> bool:
        """The stage embeds tokens (its first chunk does, on the first stage)."""
        return self.chunks[0].pre_process

    @property
    def post_process(self) -> bool:
        """The stage computes the loss (its last chunk does, on the last stage)."""
        return self.chunks[-1].post_process

    @property
    def moe_stats(self) -> MoEStats | None:
        return self.chunks[0].moe_stats

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Activations from the previous stage for the selected chunk."""
        self.chunks[self.current].set_input_tensor(tensor)

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        for chunk in self.chunks:
            chunk.set_moe_aux_loss_scale(scale)

    def set_activation_offloader(self, offloader: ActivationOffloader | None) -> None:
        """--cpu-offloading: one offloader for every chunk (its records follow each forward's own layers, so
        chunks' forwards in flight together are like 1F1B's micro-batches)."""
        for chunk in self.chunks:
            chunk.set_activation_offloader(offloader)

    def moe_routers(self) -> list[TopKRouter]:
        return [r for chunk in self.chunks for r in chunk.moe_routers()]

    def shared_embedding_weight(self) -> nn.Parameter | None:
        """The tied word-embedding copy of this stage: chunk 0's on the first stage, the last chunk's on the last
        (no stage is both: interleaving needs more than one stage)."""
        found = [w for w in (chunk.shared_embedding_weight() for chunk in self.chunks) if w is not None]
        if len(found) > 1:
            raise RuntimeError("several model chunks of one stage hold a copy of the tied word embedding")
        return found[0] if found else None


def named_chunks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix of its parameter names, chunk) for each model chunk of a stage; a plain model is its only chunk."""
    if isinstance(model, ModelChunks):
        return [(f"{PREFIX}{k}.", chunk) for k, chunk in enumerate(model.chunks)]
    return [("", model)]


def model_chunks(model: nn.Module) -> list[nn.Module]:
    return [chunk for _, chunk in named_chunks(model)]


def chunk_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The chunk that holds parameter (or buffer) ``name`` of ``model`` and the name inside that chunk."""
    for prefix, chunk in named_chunks(model):
        if name.startswith(prefix):
            return chunk, name[len(prefix):]
    raise KeyError(f"{name!r} is in no model chunk")
