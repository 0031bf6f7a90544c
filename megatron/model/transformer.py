"""Transformer layers for GPT: attention, MLP, pre-norm residual layer, and the stack with recompute.

Activations are [batch, seq, hidden]. Projections are tensor-parallel: QKV and
the first MLP layer split their outputs (column-parallel), the attention output
and the second MLP layer split their inputs (row-parallel), so each block costs
one all-reduce forward and one backward. With sequence parallelism the norms,
dropouts and residuals see 1/TP of the sequence and each all-reduce becomes an
all-gather plus a reduce-scatter. With context parallelism every rank holds
1/CP of each sequence and attention exchanges keys and values (or heads) over
the context-parallel group (megatron/core/context_parallel/).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.core import parallel_state as ps
from megatron.core.context_parallel import context_parallel_attention
from megatron.core.deferred_init import defer_norm, init_whole
from megatron.core.moe.aux_loss import AuxLossScale, MoEStats
from megatron.core.moe.layer import MoELayer
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    divide,
)
from megatron.core.transformer_config import TransformerConfig
from megatron.model.rotary import apply_rotary

if TYPE_CHECKING:
    from zero_cache.activation_offload import ActivationOffloader


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm that sees 1/TP of the sequence: its weight gradients are summed over the tensor-parallel
    ranks (identity forward, all-reduce backward), so every rank's copy gets the whole sequence's gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, copy_to_tensor_model_parallel_region(self.weight),
                            copy_to_tensor_model_parallel_region(self.bias), self.eps)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """RMSNorm over 1/TP of the sequence (see SequenceParallelLayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, copy_to_tensor_model_parallel_region(self.weight), self.eps)


def build_norm(config: TransformerConfig) -> nn.Module:
    sp = config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
    if config.normalization == "RMSNorm":
        cls = SequenceParallelRMSNorm if sp else nn.RMSNorm
    else:
        cls = SequenceParallelLayerNorm if sp else nn.LayerNorm
    return defer_norm(cls(config.hidden_size, eps=config.layernorm_epsilon))


def hidden_dropout(x: torch.Tensor, p: float, training: bool, config: TransformerConfig,
                   rng_tracker: RNGStatesTracker | None) -> torch.Tensor:
    """Dropout on the residual stream; where tensor-parallel ranks hold different tokens (sequence parallelism)
    their masks come from the tracker's per-rank stream."""
    if not training or p == 0:
        return x
    fork = rng_tracker.fork() if (config.sequence_parallel and rng_tracker is not None) else contextlib.nullcontext()
    with fork:
        return F.dropout(x, p, True)


class Attention(nn.Module):
    """Causal self-attention with grouped query heads; QKV fused per query group (Megatron's layout)."""

    def __init__(self, config: TransformerConfig, prefix: str, rng_tracker: RNGStatesTracker | None):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.config, self.rng_tracker = config, rng_tracker
        self.head_dim = config.kv_channels
        self.groups_per_rank = divide(config.num_query_groups, tp, "number of query groups")
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        fusion, sp = config.gradient_accumulation_fusion, config.sequence_parallel
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_out,
                                               bias=config.add_bias_linear or config.add_qkv_bias,
                                               init_method=config.init_method(prefix + "linear_qkv.weight"),
                                               gradient_accumulation_fusion=fusion, sequence_parallel=sp)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                             bias=config.add_bias_linear,
                                             init_method=config.output_init_method(prefix + "linear_proj.weight"),
                                             gradient_accumulation_fusion=fusion, sequence_parallel=sp)
        self.cp_size = ps.get_context_parallel_world_size()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, rotary: tuple | None) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # with sequence parallelism: the whole (local) sequence from here on
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.groups_per_rank, self.q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.q_per_group].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, self.q_per_group].transpose(1, 2)
        v = qkv[:, :, :, self.q_per_group + 1].transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.config.recompute_granularity == "selective" and self.training:
            # Only the attention core is recomputed: its inputs stay, its output and statistics are not kept.
            out = checkpoint(self.core, q, k, v, attention_mask, use_reentrant=False,
                             context_fn=lambda: _recompute_context(self.rng_tracker))
        else:
            out = self.core(q, k, v, attention_mask)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V over [b, heads, s, d]; k and v have one head per query group."""
        p = self.config.attention_dropout if self.training else 0.0
        # Heads are partitioned across TP ranks, so their dropout masks must differ per rank.
        fork = self.rng_tracker.fork() if (self.rng_tracker is not None and p > 0) else contextlib.nullcontext()
        if self.cp_size > 1:  # causal over the whole sequence (no attention mask with context parallelism)
            with fork:
                return context_parallel_attention(q, k, v, comm_type=self.config.cp_comm_type,
                                                  group=ps.get_context_parallel_group(), dropout_p=p)
        if self.q_per_group > 1:
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        with fork:
            if attention_mask is None:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            # Megatron's mask marks what may NOT be attended; SDPA's marks what may
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=p)


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, prefix: str, ffn_hidden_size: int | None = None):
        super().__init__()
        h, bias = config.hidden_size, config.add_bias_linear
        f = ffn_hidden_size or config.ffn_hidden_size
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        fusion, sp = config.gradient_accumulation_fusion, config.sequence_parallel
        self.linear_fc1 = ColumnParallelLinear(h, f, bias=bias,
                                               init_method=config.init_method(prefix + "linear_fc1.weight"),
                                               gradient_accumulation_fusion=fusion, sequence_parallel=sp)
        if self.swiglu:
            self.linear_fc1_gate = ColumnParallelLinear(
                h, f, bias=bias, init_method=config.init_method(prefix + "linear_fc1_gate.weight"),
                gradient_accumulation_fusion=fusion, sequence_parallel=sp)
        self.linear_fc2 = RowParallelLinear(f, h, bias=bias,
                                            init_method=config.output_init_method(prefix + "linear_fc2.weight"),
                                            gradient_accumulation_fusion=fusion, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            hidden = F.silu(self.linear_fc1_gate(x)) * self.linear_fc1(x)
        else:
            hidden = F.gelu(self.linear_fc1(x), approximate=self.gelu_approximate)
        return self.linear_fc2(hidden)


class SharedExpertMLP(MLP):
    """The MoE layer's shared expert: a dense MLP every token goes through, optionally scaled by a learned
    sigmoid gate (``gate_weight`` [1, hidden], Qwen-MoE's shared_expert_gate)."""

    def __init__(self, config: TransformerConfig, prefix: str):
        super().__init__(config, prefix, config.moe.shared_expert_intermediate_size)
        self.gated = config.moe.shared_expert_gate
        if self.gated:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
            init_whole(self.gate_weight, config.init_method(prefix + "gate_weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return torch.sigmoid(F.linear(x, self.gate_weight)) * out if self.gated else out


def build_mlp(config: TransformerConfig, prefix: str, layer_number: int, aux_loss_scale: AuxLossScale | None,
              moe_stats: MoEStats | None) -> nn.Module:
    """The layer's MLP: dense, or mixture-of-experts on the layers ``config.moe`` picks."""
    if not config.is_moe_layer(layer_number):
        return MLP(config, prefix)
    shared = SharedExpertMLP(config, prefix + "shared_experts.") if config.moe.shared_expert_intermediate_size \
        else None
    return MoELayer(config, prefix, layer_number, shared_expert=shared, aux_loss_scale=aux_loss_scale,
                    stats=moe_stats)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(x)))."""

    def __init__(self, config: TransformerConfig, layer_number: int, rng_tracker: RNGStatesTracker | None,
                 aux_loss_scale: AuxLossScale | None = None, moe_stats: MoEStats | None = None):
        super().__init__()
        prefix = f"decoder.layers.{layer_number}."
        self.layer_number = layer_number  # global index, 0-based
        self.input_layernorm = build_norm(config)
        self.self_attention = Attention(config, prefix + "self_attention.", rng_tracker)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = build_mlp(config, prefix + "mlp.", layer_number, aux_loss_scale, moe_stats)
        self.is_moe = config.is_moe_layer(layer_number)
        self.config, self.rng_tracker = config, rng_tracker

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return hidden_dropout(x, self.config.hidden_dropout, self.training, self.config, self.rng_tracker)

    def forward(self, x, attention_mask, rotary):
        attn = self.self_attention(self.input_layernorm(x), attention_mask, rotary)
        x = x + self._dropout(attn)
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))


def _recompute_context(rng_tracker: RNGStatesTracker | None):
    """Replay the tracker's RNG streams during recompute so dropout masks match the first forward.

    torch.utils.checkpoint restores the default generator itself; the tracker's
    named streams are ours to restore.
    """
    if rng_tracker is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    snapshot = rng_tracker.get_states()

    @contextlib.contextmanager
    def replay():
        current = rng_tracker.get_states()
        rng_tracker.set_states(snapshot)
        try:
            yield
        finally:
            rng_tracker.set_states(current)
    return contextlib.nullcontext(), replay()


class TransformerBlock(nn.Module):
    """The layers of one pipeline stage, with optional full activation recompute."""

    def __init__(self, config: TransformerConfig, layer_offset: int, num_layers: int,
                 rng_tracker: RNGStatesTracker | None, aux_loss_scale: AuxLossScale | None = None,
                 moe_stats: MoEStats | None = None):
        super().__init__()
        self.config, self.rng_tracker = config, rng_tracker
        self.layers = nn.ModuleList(
            TransformerLayer(config, layer_offset + i, rng_tracker, aux_loss_scale, moe_stats)
            for i in range(num_layers))
        # --cpu-offloading: moves the saved activations of the first cpu_offloading_num_layers layers to host
        # memory (set by the trainer once the backend's copy streams exist; zero_cache/activation_offload.py).
        self.activation_offloader: ActivationOffloader | None = None

    def _offloaded(self, x, attention_mask, rotary):
        offloader, n = self.activation_offloader, self.config.cpu_offloading_num_layers
        for i, layer in enumerate(self.layers):
            with offloader.layer(i, offload=i < n):
                x = layer(x, attention_mask, rotary)
            x = offloader.layer_output(i, x)  # its backward brings layer i's and i-1's activations back
        return x

    def _run(self, start: int, end: int):
        def run(x, attention_mask, rotary):
            for layer in self.layers[start:end]:
                x = layer(x, attention_mask, rotary)
            return x
        return run

    def _checkpointed(self, start, end, x, attention_mask, rotary):
        return checkpoint(self._run(start, end), x, attention_mask, rotary, use_reentrant=False,
                          context_fn=lambda: _recompute_context(self.rng_tracker))

    def forward(self, x, attention_mask=None, rotary=None):
        cfg, n = self.config, len(self.layers)
        if self.activation_offloader is not None and self.training and torch.is_grad_enabled():
            return self._offloaded(x, attention_mask, rotary)  # full recompute is refused with it
        if cfg.recompute_granularity != "full" or not self.training:
            return self._run(0, n)(x, attention_mask, rotary)
        k = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":
            # Checkpoint chunks of k layers: only chunk inputs are kept.
            for start in range(0, n, k):
                x = self._checkpointed(start, min(start + k, n), x, attention_mask, rotary)
            return x
        # "block": checkpoint the first k layers of the stage one by one, run the rest normally.
        for i in range(n):
            if i < k:
                x = self._checkpointed(i, i + 1, x, attention_mask, rotary)
            else:
                x = self.layers[i](x, attention_mask, rotary)
        return x
