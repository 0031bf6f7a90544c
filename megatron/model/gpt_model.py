"""GPT language model, one pipeline stage of it at a time.

The first stage embeds tokens (and learned positions), the last stage applies
the final norm and the output layer and returns the per-token loss. With tied
embeddings and several stages, the last stage keeps its own copy of the word
embedding (initialised identically, marked ``shared``); the trainer sums the
two copies' gradients over the embedding group so they stay equal.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.deferred_init import init_whole
from megatron.core.moe.aux_loss import AuxLossScale, MoEStats
from megatron.core.moe.router import TopKRouter
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.layers import initialize_partitioned_weight
from megatron.core.transformer_config import TransformerConfig
from megatron.model.rotary import rotary_cos_sin
from megatron.model.transformer import TransformerBlock, build_norm, hidden_dropout
from zero_cache.weight_grad import embedding

if TYPE_CHECKING:
    from zero_cache.activation_offload import ActivationOffloader

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class PositionEmbedding(nn.Module):
    """Learned absolute positions. Initialised inside its own ``__init__`` (like every layer here), so
    frameworks that shard each module as it is created (DeepSpeed's zero.Init) see the initial values."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        shape = (config.max_position_embeddings, config.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape))
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        init_whole(self.weight, config.init_method("embedding.position_embeddings.weight"))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return embedding(position_ids, self.weight, fuse=self.gradient_accumulation_fusion)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, virtual_stages: int = 1,
                 virtual_stage: int = 0) -> tuple[int, int]:
    """(first global layer, number of layers) of a pipeline stage's model chunk; layers must divide evenly.

    With ``virtual_stages`` v > 1 (the interleaved schedule) the model is cut into pp x v chunks and chunk k of
    stage r is the (k * pp + r)-th: each stage holds v chunks spread along the depth of the model.
    """
    if num_layers % (pp_size * virtual_stages):
        what = f"--pipeline-model-parallel-size {pp_size}" + (
            f" x --virtual-pipeline-model-parallel-size {virtual_stages}" if virtual_stages > 1 else "")
        raise ValueError(f"--num-layers {num_layers} is not divisible by {what}")
    per = num_layers // (pp_size * virtual_stages)
    return (virtual_stage * pp_size + pp_rank) * per, per


class Embedding(nn.Module):
    """Word (+ learned position) embeddings; with sequence parallelism each TP rank keeps 1/TP of the sequence."""

    def __init__(self, config: TransformerConfig, rng_tracker: RNGStatesTracker | None = None):
        super().__init__()
        self.config, self.rng_tracker = config, rng_tracker
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                      init_method=config.init_method(WORD_EMBEDDING),
                                                      gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                                                      sequence_parallel=config.sequence_parallel)
        self.learned_positions = config.position_embedding_type == "learned_absolute"
        if self.learned_positions:
            self.position_embeddings = PositionEmbedding(config)
        self.sequence_parallel = config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1

    def forward(self, tokens, position_ids):
        x = self.word_embeddings(tokens)
        if self.learned_positions:
            positions = self.position_embeddings(position_ids)
            x = x + (scatter_to_sequence_parallel_region(positions) if self.sequence_parallel else positions)
        return hidden_dropout(x, self.config.hidden_dropout, self.training, self.config, self.rng_tracker)


class GPTModel(nn.Module):
    """One model chunk of this pipeline stage: the whole stage, or with ``virtual_stages`` > 1 (the interleaved
    schedule) its ``virtual_stage``-th chunk (``stage_layers``)."""

    def __init__(self, config: TransformerConfig, *, pre_process: bool | None = None,
                 post_process: bool | None = None, rng_tracker: RNGStatesTracker | None = None,
                 virtual_stage: int = 0, virtual_stages: int = 1):
        super().__init__()
        self.config = config
        first_chunk, last_chunk = virtual_stage == 0, virtual_stage == virtual_stages - 1
        self.pre_process = ps.is_pipeline_first_stage() and first_chunk if pre_process is None else pre_process
        self.post_process = ps.is_pipeline_last_stage() and last_chunk if post_process is None else post_process
        offset, count = stage_layers(config.num_layers, ps.get_pipeline_model_parallel_world_size(),
                                     ps.get_pipeline_model_parallel_rank(), virtual_stages, virtual_stage)
        self.layer_offset = offset  # global index of this chunk's first layer
        self.input_tensor: torch.Tensor | None = None

        # Mixture of experts: the factor of the auxiliary losses' backward (set per step by the schedule) and
        # the layers' loss and load statistics (read by the log line).
        self.moe_aux_loss_scale = AuxLossScale()
        self.moe_stats = MoEStats(config.num_layers, config.moe.num_experts) if config.moe is not None else None

        if self.pre_process:
            self.embedding = Embedding(config, rng_tracker)
        self.decoder = TransformerBlock(config, offset, count, rng_tracker, self.moe_aux_loss_scale,
                                        self.moe_stats)
        if self.post_process:
            self.final_layernorm = build_norm(config)
            tied = not config.untie_embeddings_and_output_weights
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, bias=False,
                init_method=None if tied else config.init_method("output_layer.weight"),
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                sequence_parallel=config.sequence_parallel)  # gathers the sequence the final norm saw 1/TP of
            if tied and self.pre_process:
                del self.output_layer.weight  # the head reads the embedding's weight
                self.output_layer.register_parameter("weight", None)
            elif tied:
                # Last stage's copy of the tied word embedding: same init as the first stage's.
                initialize_partitioned_weight(self.output_layer.weight, (config.padded_vocab_size, config.hidden_size),
                                              0, config.init_method(WORD_EMBEDDING))
                self.output_layer.weight.shared = True  # counted once (on the first stage) in the grad norm
        self.to(config.params_dtype)

    # ----- pipeline plumbing -----
    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Activations received from the previous stage (ignored on the first stage)."""
        self.input_tensor = tensor

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """The factor the schedule multiplies the language-model loss by before backward (aux_loss.py)."""
        self.moe_aux_loss_scale.value = scale

    def set_activation_offloader(self, offloader: ActivationOffloader | None) -> None:
        """--cpu-offloading: the offloader this chunk's layers move their saved activations with."""
        self.decoder.activation_offloader = offloader

    def moe_routers(self) -> list[TopKRouter]:
        return [m for m in self.modules() if isinstance(m, TopKRouter)]

    def shared_embedding_weight(self) -> nn.Parameter | None:
        """The word-embedding copy this stage holds that must stay tied to the other end of the pipeline."""
        if self.config.untie_embeddings_and_output_weights or ps.get_pipeline_model_parallel_world_size() == 1:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def _output_weight(self) -> torch.Tensor:
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """Returns hidden states [b, s, h] on non-last stages; per-token loss [b, s] (or logits) on the last.

        ``s`` is this rank's part of the sequence: 1/CP of it with context parallelism (``tokens``,
        ``position_ids`` and ``labels`` already split), and the hidden states between stages hold 1/TP of that
        with sequence parallelism."""
        x = self.embedding(tokens, position_ids) if self.pre_process else self.input_tensor
        rotary = None
        if self.config.position_embedding_type == "rope":
            cos, sin = rotary_cos_sin(self.config.seq_length, self.config.kv_channels, self.config.rotary_base,
                                      x.device, x.dtype)
            rotary = (cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1))
        x = self.decoder(x, attention_mask, rotary)
        if not self.post_process:
            return x
        logits = self.output_layer(self.final_layernorm(x), weight=self._output_weight())
        if labels is None:
            return gather_from_tensor_model_parallel_region(logits).float()
        return vocab_parallel_cross_entropy(logits, labels)
