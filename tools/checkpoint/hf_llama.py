"""Pieces of the Llama layout that the dense mapping (hf_mapping.py) and the mixture-of-experts one
(hf_moe_mapping.py) share: the config arguments, the SwiGLU MLP's tensors, the one-line error for a config field
that does not map."""
from __future__ import annotations

from typing import Callable

import torch

from zero_cache.checkpoint import CheckpointError


def unsupported(field: str, value, fix: str) -> CheckpointError:
    return CheckpointError(f"Hugging Face config field '{field}' = {value!r} is not supported: {fix}")


def linear_params(cfg) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.add_bias_linear else ("weight",)


def swiglu_mlp(cfg, src: str, dst: str, ours: Callable[[str], torch.Tensor]):
    """Our SwiGLU MLP at ``src`` (``...mlp.``) as Llama's ``gate_proj`` / ``up_proj`` / ``down_proj`` at ``dst``."""
    for p in linear_params(cfg):
        yield dst + f"gate_proj.{p}", ours(src + f"linear_fc1_gate.{p}")  # silu(gate(x)) * up(x)
        yield dst + f"up_proj.{p}", ours(src + f"linear_fc1.{p}")
        yield dst + f"down_proj.{p}", ours(src + f"linear_fc2.{p}")


def llama_args(hf) -> dict:
    """Our arguments for a Llama-style config (Mixtral and Qwen2-MoE start from them)."""
    if hf.hidden_act != "silu":
        raise unsupported("hidden_act", hf.hidden_act, "only 'silu' (SwiGLU) maps onto our MLP")
    scaling = getattr(hf, "rope_scaling", None)
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        raise unsupported("rope_scaling", scaling, "our rotary embedding has no scaling; drop it or train "
                                                    "without it")
    if getattr(hf, "pretraining_tp", 1) != 1:
        raise unsupported("pretraining_tp", hf.pretraining_tp, "set it to 1 (it only slices the matmuls)")
    if bool(getattr(hf, "attention_bias", False)) != bool(getattr(hf, "mlp_bias", False)):
        raise unsupported("attention_bias/mlp_bias", (hf.attention_bias, hf.mlp_bias),
                           "our --disable-bias-linear covers both: they must be equal")
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    heads, groups = hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return {"num_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size, "num_attention_heads": heads,
            "ffn_hidden_size": hf.intermediate_size, "max_position_embeddings": hf.max_position_embeddings,
            "seq_length": hf.max_position_embeddings, "position_embedding_type": "rope",
            "rotary_base": float(theta), "normalization": "RMSNorm", "layernorm_epsilon": hf.rms_norm_eps,
            "swiglu": True, "add_bias_linear": bool(getattr(hf, "attention_bias", False)), "openai_gelu": False,
            "untie_embeddings_and_output_weights": not hf.tie_word_embeddings, "num_query_groups": groups,
            "group_query_attention": groups != heads, "kv_channels": head_dim, "hidden_dropout": 0.0,
            "attention_dropout": float(getattr(hf, "attention_dropout", 0.0)),
            "true_vocab_size": hf.vocab_size}
