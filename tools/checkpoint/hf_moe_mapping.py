"""How our mixture-of-experts GPT corresponds to Hugging Face ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``.

Embeddings, norms and attention are Llama's (``hf_mapping.py``, which calls this module for MoE models); here
are the MoE MLPs and the configs. Our experts are stacked: ``mlp.experts.linear_fc1_gate`` / ``linear_fc1``
``.weight`` [E, f, h] (the expert computes ``silu(x gate^T) * (x fc1^T)``) and ``mlp.experts.linear_fc2.weight``
[E, h, f]; the router is ``mlp.router.weight`` [E, h]. Hugging Face checkpoints (what ``save_pretrained`` writes
and the Hub holds) keep one matrix per expert:

    Mixtral    block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down)
    Qwen2-MoE  mlp.gate, mlp.experts.{e}.gate_proj / up_proj / down_proj, mlp.shared_expert.*, mlp.shared_expert_gate

The import also reads transformers 5's fused layout (``save_pretrained(save_original_format=False)``):
``mlp.experts.gate_up_proj`` [E, 2f, h] (gate rows first) and ``mlp.experts.down_proj`` [E, h, f]; the export
writes one matrix per expert. Both route by a softmax over all experts and its top k; Mixtral renormalises the k
weights (``pre_softmax=False``), Qwen2-MoE only with ``norm_topk_prob`` (else ``pre_softmax=True``). Qwen2-MoE's
dense layers (``mlp_only_layers``, ``decoder_sparse_step``) become ``--moe-layer-freq``, its always-gated shared
expert ``--moe-shared-expert-intermediate-size`` with ``--moe-shared-expert-gate``. Mixtral's
``router_jitter_noise`` only perturbs training inputs and is not carried over. DeepSeek-V3 is not mapped: its
multi-head latent attention and group-limited routing have no counterpart in our model.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron.core.transformer_config import TransformerConfig
from tools.checkpoint.hf_llama import llama_args, swiglu_mlp, unsupported
from zero_cache.checkpoint import CheckpointError

MODEL_TYPES = ("mixtral", "qwen2_moe")
_ARCHITECTURE = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
_EXPERT = {"mixtral": {"linear_fc1_gate": "w1", "linear_fc1": "w3", "linear_fc2": "w2"},
           "qwen2_moe": {"linear_fc1_gate": "gate_proj", "linear_fc1": "up_proj", "linear_fc2": "down_proj"}}
_SHARED = {"linear_fc1_gate": "gate_proj", "linear_fc1": "up_proj", "linear_fc2": "down_proj"}


def moe_family(cfg: TransformerConfig) -> str:
    """'mixtral' (no shared expert) or 'qwen2_moe' (a gated shared expert); a clear error for MoE designs neither
    Hugging Face class reproduces."""
    moe = cfg.moe
    family = "qwen2_moe" if moe.shared_expert_intermediate_size else "mixtral"
    wrong = {"position_embedding_type": (cfg.position_embedding_type, "rope"),
             "normalization": (cfg.normalization, "RMSNorm"), "swiglu": (cfg.swiglu, True),
             "add_bias_linear": (cfg.add_bias_linear, False), "moe.score_function": (moe.score_function, "softmax"),
             "moe.topk_scaling_factor": (moe.topk_scaling_factor or 1.0, 1.0),
             "moe.enable_expert_bias": (moe.enable_expert_bias, False)}
    if family == "mixtral":
        every_layer = all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        wrong.update({"add_qkv_bias": (cfg.add_qkv_bias, False), "moe.pre_softmax": (moe.pre_softmax, False),
                      "moe.layer_freq": (moe.layer_freq if not every_layer else 1, 1)})
    else:
        wrong["moe.shared_expert_gate"] = (moe.shared_expert_gate, True)
    bad = {k: v for k, v in wrong.items() if v[0] != v[1]}
    if bad:
        need = ", ".join(f"{k}={v[1]!r}" for k, v in bad.items())
        raise CheckpointError(f"this mixture-of-experts model ({', '.join(f'{k}={v[0]!r}' for k, v in bad.items())}) "
                              f"matches neither Hugging Face Mixtral (every layer MoE, renormalised top-k softmax, no "
                              f"shared expert) nor Qwen2-MoE (a gated shared expert); a {family} export needs {need}")
    return family


# ---- ours -> Hugging Face (export) ---------------------------------------------------------------------------
def mlp_tensors(cfg: TransformerConfig, family: str, i: int, ours: Callable[[str], torch.Tensor]):
    """Layer ``i``'s MLP (MoE or dense) as Hugging Face tensors, one matrix per expert."""
    src = f"decoder.layers.{i}.mlp."
    if not cfg.is_moe_layer(i):
        yield from swiglu_mlp(cfg, src, f"model.layers.{i}.mlp.", ours)
        return
    dst = f"model.layers.{i}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}."
    yield dst + "gate.weight", ours(src + "router.weight")
    for name, theirs in _EXPERT[family].items():
        stacked = ours(src + f"experts.{name}.weight")
        for e in range(stacked.shape[0]):
            yield dst + f"experts.{e}.{theirs}.weight", stacked[e].clone()  # safetensors refuses shared storage
    if family == "qwen2_moe":
        yield from swiglu_mlp(cfg, src + "shared_experts.", dst + "shared_expert.", ours)
        yield dst + "shared_expert_gate.weight", ours(src + "shared_experts.gate_weight")


def hf_config(cfg: TransformerConfig, vocab_size: int, family: str):
    """The Hugging Face config of our MoE model."""
    from transformers import MixtralConfig, Qwen2MoeConfig
    moe, layers = cfg.moe, cfg.num_layers
    common = dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=layers,
                  num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                  hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
                  rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rotary_base, attention_dropout=0.0,
                  num_experts_per_tok=moe.router_topk, router_aux_loss_coef=moe.aux_loss_coeff,
                  tie_word_embeddings=not cfg.untie_embeddings_and_output_weights, bos_token_id=None,
                  eos_token_id=None, architectures=[_ARCHITECTURE[family]])
    if cfg.kv_channels != cfg.hidden_size // cfg.num_attention_heads:
        common["head_dim"] = cfg.kv_channels
    expert_ffn = moe.expert_ffn_hidden_size(cfg.ffn_hidden_size)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=expert_ffn, num_local_experts=moe.num_experts,
                             sliding_window=None)
    pattern = [cfg.is_moe_layer(i) for i in range(layers)]
    # Qwen2-MoE's layer i has experts when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    step = next((s for s in range(1, layers + 1) if pattern == [(i + 1) % s == 0 for i in range(layers)]), 1)
    dense = [i for i in range(layers) if not pattern[i]] if step == 1 else []
    return Qwen2MoeConfig(**common, intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=expert_ffn,
                          shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                          num_experts=moe.num_experts, norm_topk_prob=not moe.pre_softmax,
                          decoder_sparse_step=step, mlp_only_layers=dense, qkv_bias=cfg.add_qkv_bias,
                          use_sliding_window=False)


# ---- Hugging Face -> ours (import) ---------------------------------------------------------------------------
def args_from_hf(hf) -> dict:
    """Our model arguments (Megatron names, ``--num-experts`` and the ``--moe-*`` ones included) for a Mixtral or
    Qwen2-MoE config; unsupported fields are an error naming the field."""
    layers = hf.num_hidden_layers
    if hf.model_type == "mixtral":
        window = getattr(hf, "sliding_window", None)
        if window is not None and window < hf.max_position_embeddings:
            raise unsupported("sliding_window", window, "our attention sees the whole sequence; set it to null "
                                                         "(or >= max_position_embeddings)")
        experts, expert_ffn, shared, pre_softmax, freq = hf.num_local_experts, hf.intermediate_size, None, False, "1"
        qkv_bias = False
    else:
        if "sliding_attention" in (getattr(hf, "layer_types", None) or []):
            raise unsupported("use_sliding_window", hf.use_sliding_window, "our attention sees the whole "
                                                                           "sequence; set it to false")
        if not hf.shared_expert_intermediate_size:
            raise unsupported("shared_expert_intermediate_size", hf.shared_expert_intermediate_size,
                               "a Qwen2-MoE without its shared expert is not mapped")
        experts, expert_ffn, shared = hf.num_experts, hf.moe_intermediate_size, hf.shared_expert_intermediate_size
        pre_softmax, qkv_bias = not hf.norm_topk_prob, bool(hf.qkv_bias)
        pattern = [int(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0) for i in range(layers)]
        freq = "1" if all(pattern) else f"[{','.join(map(str, pattern))}]"  # as the trainer stores the flag
    if experts < 2:
        raise unsupported("num_experts", experts, "a mixture of experts needs at least 2 (convert a dense model "
                                                   "as Llama)")
    args = llama_args(hf)
    args.update(add_bias_linear=False, add_qkv_bias=qkv_bias, num_experts=experts,
                moe_router_topk=hf.num_experts_per_tok, moe_ffn_hidden_size=expert_ffn, moe_layer_freq=freq,
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=shared is not None,
                moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax,
                moe_aux_loss_coeff=float(hf.router_aux_loss_coef))
    return args


def _moe_block(family: str, layer: int, hf) -> str:
    """Where layer's experts lie: Mixtral's checkpoints say ``block_sparse_moe``, the fused layout ``mlp``."""
    mixtral = f"model.layers.{layer}.block_sparse_moe."
    return mixtral if family == "mixtral" and mixtral + "gate.weight" in hf else f"model.layers.{layer}.mlp."


def our_mlp_tensor(cfg: TransformerConfig, family: str, layer: int, rest: str, hf) -> torch.Tensor:
    """One of our MoE-layer tensors (``rest``: its name after ``decoder.layers.{layer}.``) from Hugging Face's;
    ``hf(name)`` reads one of theirs and ``name in hf`` says whether it exists."""
    block = _moe_block(family, layer, hf)
    if rest == "mlp.router.weight":
        return hf(block + "gate.weight")
    if rest == "mlp.shared_experts.gate_weight":
        return hf(block + "shared_expert_gate.weight")
    module, kind = rest.rsplit(".", 1)
    shared, linear = module.removeprefix("mlp.shared_experts."), module.removeprefix("mlp.experts.")
    if shared in _SHARED:
        return hf(f"{block}shared_expert.{_SHARED[shared]}.{kind}")
    if linear not in _EXPERT[family] or kind != "weight":
        raise KeyError(rest)
    per_expert = [f"{block}experts.{e}.{_EXPERT[family][linear]}.weight" for e in range(cfg.moe.num_experts)]
    if per_expert[0] in hf:
        return torch.stack([hf(name) for name in per_expert])
    if linear == "linear_fc2":
        return hf(block + "experts.down_proj")
    gate, up = hf(block + "experts.gate_up_proj").chunk(2, dim=1)
    return gate if linear == "linear_fc1_gate" else up
