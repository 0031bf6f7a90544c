"""How our GPT weights and arguments correspond to Hugging Face ``GPT2LMHeadModel`` and ``LlamaForCausalLM``
(mixture-of-experts models, ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``: ``hf_moe_mapping.py``, which
these functions hand over to).

Both directions work one tensor at a time, so a conversion holds one layer's tensors, never the model:
``hf_tensors`` yields the Hugging Face tensors of our (full, single-process) weights; ``our_tensor`` builds one of
our tensors from Hugging Face tensors. Our fused QKV weight is laid out per query group:
``[q_per_group * d queries | d key | d value]`` rows for each group (Megatron's layout); GPT-2's ``Conv1D``
stores ``[in, out]``, so its matrices are transposed. The vocabulary is padded to a multiple of
``--make-vocab-size-divisible-by`` x TP in our model: imported rows beyond Hugging Face's ``vocab_size`` are
zero, exported tensors are cut back to it.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from megatron.core.transformer_config import TransformerConfig
from tools.checkpoint import hf_moe_mapping
from tools.checkpoint.hf_llama import linear_params, llama_args, swiglu_mlp, unsupported
from zero_cache.checkpoint import CheckpointError

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}  # -> openai_gelu


def model_family(cfg: TransformerConfig) -> str:
    """'gpt2', 'llama', 'mixtral' or 'qwen2_moe'; a clear error for block designs no Hugging Face class reproduces."""
    if cfg.moe is not None:
        return hf_moe_mapping.moe_family(cfg)
    if cfg.position_embedding_type == "learned_absolute":
        wrong = {"normalization": (cfg.normalization, "LayerNorm"), "swiglu": (cfg.swiglu, False),
                 "add_bias_linear": (cfg.add_bias_linear, True),
                 "num_query_groups": (cfg.num_query_groups, cfg.num_attention_heads),
                 "kv_channels": (cfg.kv_channels, cfg.hidden_size // cfg.num_attention_heads)}
        family = "gpt2"
    else:
        wrong = {"normalization": (cfg.normalization, "RMSNorm"), "swiglu": (cfg.swiglu, True),
                 "openai_gelu": (cfg.openai_gelu, False),
                 "add_qkv_bias": (cfg.add_qkv_bias and not cfg.add_bias_linear, False)}  # Qwen2's attention
        family = "llama"
    bad = {k: v for k, v in wrong.items() if v[0] != v[1]}
    if bad:
        need = ", ".join(f"{k}={v[1]!r}" for k, v in bad.items())
        raise CheckpointError(f"this model ({', '.join(f'{k}={v[0]!r}' for k, v in bad.items())}) matches neither "
                              f"Hugging Face GPT-2 (learned positions, LayerNorm, GELU, biases, MHA) nor Llama "
                              f"(rope, RMSNorm, SwiGLU); a {family} export needs {need}")
    return family


# ---- QKV layout -------------------------------------------------------------------------------------------
def split_qkv(cfg: TransformerConfig, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV rows -> q, k, v (head-major rows)."""
    groups, d = cfg.num_query_groups, cfg.kv_channels
    q_per_group = cfg.num_attention_heads // groups
    t = t.reshape(groups, q_per_group + 2, d, *t.shape[1:])
    rest = t.shape[3:]
    q = t[:, :q_per_group].reshape(groups * q_per_group * d, *rest)
    return q, t[:, q_per_group].reshape(groups * d, *rest), t[:, q_per_group + 1].reshape(groups * d, *rest)


def fuse_qkv(cfg: TransformerConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v (head-major rows) -> our fused QKV rows (the inverse of ``split_qkv``)."""
    groups, d = cfg.num_query_groups, cfg.kv_channels
    q_per_group = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    parts = [q.reshape(groups, q_per_group, d, *rest), k.reshape(groups, 1, d, *rest),
             v.reshape(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape((cfg.num_attention_heads + 2 * groups) * d, *rest)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with exactly ``n`` rows: cut, or padded with zero rows."""
    if t.shape[0] >= n:
        return t[:n]
    return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])


# ---- ours -> Hugging Face (export) ---------------------------------------------------------------------------
def _gpt2_layer(cfg, i: int, ours: Callable[[str], torch.Tensor]):
    src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
    yield dst + "ln_1.weight", ours(src + "input_layernorm.weight")
    yield dst + "ln_1.bias", ours(src + "input_layernorm.bias")
    yield dst + "attn.c_attn.weight", torch.cat(split_qkv(cfg, ours(src + "self_attention.linear_qkv.weight"))).t()
    yield dst + "attn.c_attn.bias", torch.cat(split_qkv(cfg, ours(src + "self_attention.linear_qkv.bias")))
    yield dst + "attn.c_proj.weight", ours(src + "self_attention.linear_proj.weight").t()
    yield dst + "attn.c_proj.bias", ours(src + "self_attention.linear_proj.bias")
    yield dst + "ln_2.weight", ours(src + "pre_mlp_layernorm.weight")
    yield dst + "ln_2.bias", ours(src + "pre_mlp_layernorm.bias")
    yield dst + "mlp.c_fc.weight", ours(src + "mlp.linear_fc1.weight").t()
    yield dst + "mlp.c_fc.bias", ours(src + "mlp.linear_fc1.bias")
    yield dst + "mlp.c_proj.weight", ours(src + "mlp.linear_fc2.weight").t()
    yield dst + "mlp.c_proj.bias", ours(src + "mlp.linear_fc2.bias")


def llama_attention(cfg, i: int, ours: Callable[[str], torch.Tensor]):
    """Layer ``i``'s norms and attention under Llama's names (Mixtral and Qwen2-MoE use them too)."""
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    yield dst + "input_layernorm.weight", ours(src + "input_layernorm.weight")
    yield dst + "post_attention_layernorm.weight", ours(src + "pre_mlp_layernorm.weight")
    for p in qkv_params(cfg):
        q, k, v = split_qkv(cfg, ours(src + f"self_attention.linear_qkv.{p}"))
        yield dst + f"self_attn.q_proj.{p}", q
        yield dst + f"self_attn.k_proj.{p}", k
        yield dst + f"self_attn.v_proj.{p}", v
    for p in linear_params(cfg):
        yield dst + f"self_attn.o_proj.{p}", ours(src + f"self_attention.linear_proj.{p}")


def qkv_params(cfg) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.add_bias_linear or cfg.add_qkv_bias else ("weight",)


def hf_tensors(cfg: TransformerConfig, vocab_size: int, ours: Callable[[str], torch.Tensor]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face state dict of our full weights, tensor by tensor (``ours(name)`` reads one of ours).
    Tied heads are left out, as ``save_pretrained`` leaves them out."""
    family = model_family(cfg)
    tied = not cfg.untie_embeddings_and_output_weights
    if family == "gpt2":
        yield "transformer.wte.weight", _rows(ours(WORD_EMBEDDING), vocab_size)
        yield "transformer.wpe.weight", ours("embedding.position_embeddings.weight")
        for i in range(cfg.num_layers):
            yield from _gpt2_layer(cfg, i, ours)
        yield "transformer.ln_f.weight", ours("final_layernorm.weight")
        yield "transformer.ln_f.bias", ours("final_layernorm.bias")
    else:
        yield "model.embed_tokens.weight", _rows(ours(WORD_EMBEDDING), vocab_size)
        for i in range(cfg.num_layers):
            yield from llama_attention(cfg, i, ours)
            if family == "llama":
                yield from swiglu_mlp(cfg, f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp.", ours)
            else:
                yield from hf_moe_mapping.mlp_tensors(cfg, family, i, ours)
        yield "model.norm.weight", ours("final_layernorm.weight")
    if not tied:
        yield "lm_head.weight", _rows(ours(OUTPUT_LAYER), vocab_size)


def hf_config(cfg: TransformerConfig, vocab_size: int):
    """The Hugging Face config of our model."""
    from transformers import GPT2Config, LlamaConfig
    tied = not cfg.untie_embeddings_and_output_weights
    family = model_family(cfg)
    if family not in ("gpt2", "llama"):
        return hf_moe_mapping.hf_config(cfg, vocab_size, family)
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
            activation_function="gelu_new" if cfg.openai_gelu else "gelu", layer_norm_epsilon=cfg.layernorm_epsilon,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=None,
            eos_token_id=None, architectures=["GPT2LMHeadModel"])
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.layernorm_epsilon,
        rope_theta=cfg.rotary_base, attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
        attention_dropout=0.0, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
        architectures=["LlamaForCausalLM"])


# ---- Hugging Face -> ours (import) ---------------------------------------------------------------------------
def args_from_hf(hf) -> dict:
    """Our model arguments (Megatron names) for a Hugging Face config; unsupported fields are an error naming
    the field."""
    model_type = getattr(hf, "model_type", None)
    if model_type == "gpt2":
        act = hf.activation_function
        if act not in GPT2_ACTIVATIONS:
            raise unsupported("activation_function", act, f"supported: {sorted(GPT2_ACTIVATIONS)}")
        for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if getattr(hf, field, ok) != ok:
                raise unsupported(field, getattr(hf, field), f"only {ok!r} maps onto our attention")
        return {"num_layers": hf.n_layer, "hidden_size": hf.n_embd, "num_attention_heads": hf.n_head,
                "ffn_hidden_size": hf.n_inner or 4 * hf.n_embd, "max_position_embeddings": hf.n_positions,
                "seq_length": hf.n_positions, "position_embedding_type": "learned_absolute",
                "normalization": "LayerNorm", "layernorm_epsilon": hf.layer_norm_epsilon, "swiglu": False,
                "add_bias_linear": True, "openai_gelu": GPT2_ACTIVATIONS[act],
                "untie_embeddings_and_output_weights": not hf.tie_word_embeddings,
                "num_query_groups": hf.n_head, "group_query_attention": False,
                "kv_channels": hf.n_embd // hf.n_head, "hidden_dropout": hf.resid_pdrop,
                "attention_dropout": hf.attn_pdrop, "true_vocab_size": hf.vocab_size}
    if model_type == "llama":
        return llama_args(hf)
    if model_type in hf_moe_mapping.MODEL_TYPES:
        return hf_moe_mapping.args_from_hf(hf)
    raise unsupported("model_type", model_type, "supported: 'gpt2' (GPT2LMHeadModel), 'llama' (LlamaForCausalLM), "
                                                 "'mixtral' (MixtralForCausalLM), 'qwen2_moe' (Qwen2MoeForCausalLM)")


_GPT2_LAYER = {"input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
               "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
               "self_attention.linear_proj.bias": "attn.c_proj.bias", "mlp.linear_fc1.bias": "mlp.c_fc.bias",
               "mlp.linear_fc2.bias": "mlp.c_proj.bias"}
_GPT2_LAYER_T = {"self_attention.linear_proj.weight": "attn.c_proj.weight", "mlp.linear_fc1.weight": "mlp.c_fc.weight",
                 "mlp.linear_fc2.weight": "mlp.c_proj.weight"}
_LLAMA_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
                "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc1_gate": "mlp.gate_proj",
                "mlp.linear_fc1": "mlp.up_proj", "mlp.linear_fc2": "mlp.down_proj"}


def our_tensor(cfg: TransformerConfig, name: str, hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """One of our full tensors from Hugging Face tensors (``hf(name)`` reads one of theirs)."""
    family = model_family(cfg)
    vocab = cfg.padded_vocab_size
    if family == "gpt2":
        head = {WORD_EMBEDDING: lambda: _rows(hf("transformer.wte.weight"), vocab),
                "embedding.position_embeddings.weight": lambda: hf("transformer.wpe.weight"),
                "final_layernorm.weight": lambda: hf("transformer.ln_f.weight"),
                "final_layernorm.bias": lambda: hf("transformer.ln_f.bias"),
                OUTPUT_LAYER: lambda: _rows(hf("lm_head.weight"), vocab)}
    else:
        head = {WORD_EMBEDDING: lambda: _rows(hf("model.embed_tokens.weight"), vocab),
                "final_layernorm.weight": lambda: hf("model.norm.weight"),
                OUTPUT_LAYER: lambda: _rows(hf("lm_head.weight"), vocab)}
    if name in head:
        return head[name]()
    prefix, layer, rest = name.split(".", 2)[0], name.split(".")[2], name.split(".", 3)[3]
    if prefix != "decoder":
        raise KeyError(name)
    if family == "gpt2":
        src = f"transformer.h.{layer}."
        if rest in _GPT2_LAYER:
            return hf(src + _GPT2_LAYER[rest])
        if rest in _GPT2_LAYER_T:
            return hf(src + _GPT2_LAYER_T[rest]).t().contiguous()
        if rest == "self_attention.linear_qkv.weight":
            return fuse_qkv(cfg, *hf(src + "attn.c_attn.weight").t().chunk(3))
        if rest == "self_attention.linear_qkv.bias":
            return fuse_qkv(cfg, *hf(src + "attn.c_attn.bias").chunk(3))
        raise KeyError(name)
    if rest.startswith("mlp.") and cfg.is_moe_layer(int(layer)):
        return hf_moe_mapping.our_mlp_tensor(cfg, family, int(layer), rest, hf)
    src = f"model.layers.{layer}."
    if rest in _LLAMA_LAYER:
        return hf(src + _LLAMA_LAYER[rest])
    module, kind = rest.rsplit(".", 1)
    if module == "self_attention.linear_qkv":
        return fuse_qkv(cfg, *(hf(src + f"self_attn.{p}_proj.{kind}") for p in "qkv"))
    return hf(src + _LLAMA_LAYER[module] + "." + kind)
