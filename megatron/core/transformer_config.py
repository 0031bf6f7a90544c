"""The shape and numerics of a GPT model, passed explicitly to every module that builds a part of it."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from megatron.core.moe.config import MoEConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Context-parallel attention (megatron/core/context_parallel/): ring, all-to-all (Ulysses), gathered keys/values.
CP_COMM_TYPES = ("p2p", "a2a", "allgather")
CP_COMM_TYPES_WITHOUT_DROPOUT = ("p2p", "allgather")  # their block kernels take no attention dropout


@dataclass(frozen=True)
class TransformerConfig:
    num_layers: int  # transformer layers of the whole model
    hidden_size: int  # width of the residual stream
    num_attention_heads: int
    seq_length: int  # tokens per sample
    padded_vocab_size: int  # rows of the (whole) word embedding and output head
    ffn_hidden_size: int | None = None  # default 4 * hidden
    num_query_groups: int | None = None  # GQA; default = heads (plain multi-head attention)
    kv_channels: int | None = None  # default hidden / heads
    max_position_embeddings: int | None = None  # default seq_length
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0  # rope frequency base
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5  # added to the variance in LayerNorm / RMSNorm
    swiglu: bool = False  # gated (SwiGLU) MLP instead of GeLU
    openai_gelu: bool = False  # GELU's tanh approximation (GPT-2's "gelu_new") instead of the exact erf form
    add_bias_linear: bool = True  # biases in the attention and MLP projections
    add_qkv_bias: bool = False  # biases in the QKV projection only (Qwen2), whatever add_bias_linear says
    untie_embeddings_and_output_weights: bool = False  # a separate output head instead of the word embedding
    hidden_dropout: float = 0.1  # dropout on the embeddings and the attention / MLP outputs
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    init_method_std: float = 0.02  # std of the normal weight initialisation
    precision: str = "fp32"  # fp32 | bf16 | fp16
    recompute_granularity: str | None = None  # "full", "selective" (the attention core only) or None
    recompute_method: str = "uniform"  # uniform | block
    recompute_num_layers: int = 1  # layers per recompute chunk (uniform) or recomputed layers per stage (block)
    # Activations saved by the first N layers of each model chunk go to host memory (-1: all but its last layer).
    cpu_offloading_num_layers: int = 0
    # Mesh-dependent behaviour (the sizes themselves come from parallel_state):
    sequence_parallel: bool = False  # outside the tensor-parallel regions, TP ranks hold 1/TP of the sequence
    cp_comm_type: str = "p2p"  # context-parallel attention: p2p (ring) | a2a (sequence <-> heads) | allgather (k, v)
    seed: int = 1234  # weights are initialised from (seed, parameter name)
    # Linear and embedding layers add their weight gradient into the gradient buffer (DDP's main_grad or the ZeRO
    # engine's) themselves: autograd allocates no gradient tensor per matrix or embedding table.
    gradient_accumulation_fusion: bool = True
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (megatron/core/moe/); None: a dense model

    def __post_init__(self):
        defaults = {
            "ffn_hidden_size": 4 * self.hidden_size,
            "num_query_groups": self.num_attention_heads,
            "max_position_embeddings": self.seq_length,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                                 f"{self.num_attention_heads}; set --kv-channels or change the sizes")
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                             f"--num-query-groups {self.num_query_groups}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(f"unknown --position-embedding-type {self.position_embedding_type!r}; "
                             "use learned_absolute or rope")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unknown --normalization {self.normalization!r}; use LayerNorm or RMSNorm")
        if self.precision not in _DTYPES:
            raise ValueError(f"unknown precision {self.precision!r}")
        if self.seq_length > self.max_position_embeddings and self.position_embedding_type == "learned_absolute":
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}")

    @property
    def params_dtype(self) -> torch.dtype:
        return _DTYPES[self.precision]

    def init_method(self, name: str, std: float | None = None) -> Callable[[torch.Tensor], None]:
        """A normal init seeded by (seed, parameter name): the same weights under every TP/PP layout."""
        std = self.init_method_std if std is None else std
        seed = (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)

        def init(t: torch.Tensor) -> None:
            t.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
        return init

    def output_init_method(self, name: str) -> Callable[[torch.Tensor], None]:
        """Projections into the residual stream get std / sqrt(2 * layers) (GPT-2 / Megatron)."""
        return self.init_method(name, self.init_method_std / (2.0 * self.num_layers) ** 0.5)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer, self.num_layers)

    def _mlp_parameters(self, layer: int, active: bool) -> int:
        """Parameters of one layer's MLP; ``active``: those one token computes with (its top-k experts)."""
        h, b = self.hidden_size, 1 if self.add_bias_linear else 0
        mats = 3 if self.swiglu else 2
        if not self.is_moe_layer(layer):
            f = self.ffn_hidden_size
            return (mats - 1) * (h * f + b * f) + f * h + b * h
        moe = self.moe
        f = moe.expert_ffn_hidden_size(self.ffn_hidden_size)
        experts = moe.router_topk if active else moe.num_experts
        total = experts * mats * h * f + moe.num_experts * h  # bias-free experts, and the router
        fs = moe.shared_expert_intermediate_size
        if fs:  # a dense MLP (with the dense layers' biases), and its gate
            total += (mats - 1) * (h * fs + b * fs) + fs * h + b * h + (h if moe.shared_expert_gate else 0)
        return total

    def num_parameters(self, vocab_size: int | None = None, *, active: bool = False) -> int:
        """Parameters of the whole (unpartitioned) model; ``active``: only the top-k experts of each MoE layer
        count (what a token computes with)."""
        h, L = self.hidden_size, self.num_layers
        v = vocab_size or self.padded_vocab_size
        d, nq, ng = self.kv_channels, self.num_attention_heads, self.num_query_groups
        b = 1 if self.add_bias_linear else 0
        qkv_b = 1 if (self.add_bias_linear or self.add_qkv_bias) else 0
        attn = h * (nq + 2 * ng) * d + qkv_b * (nq + 2 * ng) * d + nq * d * h + b * h
        norms = 2 * h * (2 if self.normalization == "LayerNorm" else 1)
        layers = sum(attn + norms + self._mlp_parameters(i, active) for i in range(L))
        emb = v * h + (self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0)
        head = v * h if self.untie_embeddings_and_output_weights else 0
        final_norm = h * (2 if self.normalization == "LayerNorm" else 1)
        return layers + emb + head + final_norm

    def flops_per_token(self) -> float:
        """Model FLOPs (forward + backward, no recompute) per token: 6 x active matmul params + attention scores."""
        h = self.hidden_size
        pos = self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0
        lookup_only = self.padded_vocab_size * h if self.untie_embeddings_and_output_weights else 0
        matmul_params = self.num_parameters(active=True) - pos - lookup_only
        attention = 12 * self.num_layers * self.seq_length * self.num_attention_heads * self.kv_channels
        return 6.0 * matmul_params + attention
