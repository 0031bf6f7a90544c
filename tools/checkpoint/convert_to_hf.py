"""Export a Megatron-layout GPT checkpoint (any TP/PP) to a Hugging Face transformers model directory.

    python tools/checkpoint/convert_to_hf.py --load CKPT_DIR [--iteration N] --output HF_DIR
    python tools/checkpoint/convert_to_hf.py --state-dict full_fp32.pt --args-from CKPT_DIR|args.json --output HF_DIR

GPT-2 blocks (learned positions, LayerNorm, GELU, biases) become ``GPT2LMHeadModel``;
Llama blocks (RoPE, RMSNorm, SwiGLU, optional GQA / untied head) become
``LlamaForCausalLM``. The model's shape comes from the checkpoint's ``args``.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from megatron.core.transformer_config import TransformerConfig
from megatron.training.checkpointing import CheckpointError
from tools.checkpoint.loader import (
    OUTPUT_LAYER,
    WORD_EMBEDDING,
    load_args_from,
    load_consolidated_state_dict,
    load_full_state_dict,
    model_config_from_args,
)


def split_qkv(cfg: TransformerConfig, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QKV rows laid out per query group [q_per_group*d queries | d key | d value] -> q, k, v (head-major)."""
    groups, d = cfg.num_query_groups, cfg.kv_channels
    q_per_group = cfg.num_attention_heads // groups
    t = t.reshape(groups, q_per_group + 2, d, *t.shape[1:])
    rest = t.shape[3:]
    q = t[:, :q_per_group].reshape(groups * q_per_group * d, *rest)
    return q, t[:, q_per_group].reshape(groups * d, *rest), t[:, q_per_group + 1].reshape(groups * d, *rest)


def model_family(cfg: TransformerConfig) -> str:
    """'gpt2' or 'llama'; a clear error for block designs neither Hugging Face class reproduces."""
    if cfg.position_embedding_type == "learned_absolute":
        wrong = {"normalization": (cfg.normalization, "LayerNorm"), "swiglu": (cfg.swiglu, False),
                 "add_bias_linear": (cfg.add_bias_linear, True),
                 "num_query_groups": (cfg.num_query_groups, cfg.num_attention_heads),
                 "kv_channels": (cfg.kv_channels, cfg.hidden_size // cfg.num_attention_heads)}
        family = "gpt2"
    else:
        wrong = {"normalization": (cfg.normalization, "RMSNorm"), "swiglu": (cfg.swiglu, True)}
        family = "llama"
    bad = {k: v for k, (v, want) in wrong.items() if v != want}
    if bad:
        need = ", ".join(f"{k}={wrong[k][1]!r}" for k in bad)
        raise CheckpointError(f"this model ({', '.join(f'{k}={v!r}' for k, v in bad.items())}) matches neither "
                              f"Hugging Face GPT-2 (learned positions, LayerNorm, GELU, biases, MHA) nor Llama "
                              f"(rope, RMSNorm, SwiGLU); a {family} export needs {need}")
    return family


def _lm_head(cfg: TransformerConfig, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    return sd[OUTPUT_LAYER] if cfg.untie_embeddings_and_output_weights else sd[WORD_EMBEDDING]


def gpt2_model(cfg: TransformerConfig, sd: dict[str, torch.Tensor]) -> GPT2LMHeadModel:
    hf_cfg = GPT2Config(
        vocab_size=cfg.padded_vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
        activation_function="gelu",  # exact erf GELU, as F.gelu in our MLP
        layer_norm_epsilon=cfg.layernorm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights, bos_token_id=None, eos_token_id=None)
    out = {"transformer.wte.weight": sd[WORD_EMBEDDING],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": sd["final_layernorm.weight"], "transformer.ln_f.bias": sd["final_layernorm.bias"],
           "lm_head.weight": _lm_head(cfg, sd)}
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        # GPT-2's Conv1D stores [in, out]: transpose our [out, in] Linear weights.
        out[dst + "attn.c_attn.weight"] = torch.cat(split_qkv(cfg, sd[src + "self_attention.linear_qkv.weight"])).t()
        out[dst + "attn.c_attn.bias"] = torch.cat(split_qkv(cfg, sd[src + "self_attention.linear_qkv.bias"]))
        out[dst + "attn.c_proj.weight"] = sd[src + "self_attention.linear_proj.weight"].t()
        out[dst + "attn.c_proj.bias"] = sd[src + "self_attention.linear_proj.bias"]
        out[dst + "mlp.c_fc.weight"] = sd[src + "mlp.linear_fc1.weight"].t()
        out[dst + "mlp.c_fc.bias"] = sd[src + "mlp.linear_fc1.bias"]
        out[dst + "mlp.c_proj.weight"] = sd[src + "mlp.linear_fc2.weight"].t()
        out[dst + "mlp.c_proj.bias"] = sd[src + "mlp.linear_fc2.bias"]
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[dst + theirs + ".weight"] = sd[src + ours + ".weight"]
            out[dst + theirs + ".bias"] = sd[src + ours + ".bias"]
    return _instantiate(GPT2LMHeadModel, hf_cfg, out, cfg.params_dtype)


def llama_model(cfg: TransformerConfig, sd: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    hf_cfg = LlamaConfig(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.layernorm_epsilon,
        rope_theta=cfg.rotary_base, attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
        attention_dropout=0.0, tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        bos_token_id=None, eos_token_id=None)
    out = {"model.embed_tokens.weight": sd[WORD_EMBEDDING], "model.norm.weight": sd["final_layernorm.weight"],
           "lm_head.weight": _lm_head(cfg, sd)}
    params = ["weight", "bias"] if cfg.add_bias_linear else ["weight"]
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"]
        for p in params:
            q, k, v = split_qkv(cfg, sd[src + f"self_attention.linear_qkv.{p}"])
            out.update({dst + f"self_attn.q_proj.{p}": q, dst + f"self_attn.k_proj.{p}": k,
                        dst + f"self_attn.v_proj.{p}": v,
                        dst + f"self_attn.o_proj.{p}": sd[src + f"self_attention.linear_proj.{p}"],
                        # our SwiGLU is silu(fc1_gate(x)) * fc1(x)
                        dst + f"mlp.gate_proj.{p}": sd[src + f"mlp.linear_fc1_gate.{p}"],
                        dst + f"mlp.up_proj.{p}": sd[src + f"mlp.linear_fc1.{p}"],
                        dst + f"mlp.down_proj.{p}": sd[src + f"mlp.linear_fc2.{p}"]})
    return _instantiate(LlamaForCausalLM, hf_cfg, out, cfg.params_dtype)


def _instantiate(cls, hf_cfg, state: dict[str, torch.Tensor], dtype: torch.dtype) -> PreTrainedModel:
    model = cls(hf_cfg).to(dtype)
    model.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True)
    return model.eval()


def to_hf_model(cfg: TransformerConfig, sd: dict[str, torch.Tensor]) -> PreTrainedModel:
    """The Hugging Face model holding exactly the weights of a full (TP = PP = 1 names) state dict."""
    return gpt2_model(cfg, sd) if model_family(cfg) == "gpt2" else llama_model(cfg, sd)


def convert(output: str, *, load: str | None = None, iteration: int | None = None, state_dict: str | None = None,
            args_from: str | None = None) -> PreTrainedModel:
    """Read a checkpoint (or a consolidated state dict + args) and write a Hugging Face model to ``output``."""
    if (load is None) == (state_dict is None):
        raise CheckpointError("give exactly one input: --load CKPT_DIR, or --state-dict FILE with --args-from")
    if state_dict is not None:
        if args_from is None and os.path.isfile(os.path.join(state_dict, "args.json")):
            args_from = os.path.join(state_dict, "args.json")  # written by zero_to_fp32.py
        if args_from is None:
            raise CheckpointError("--state-dict needs --args-from CKPT_DIR|args.json for the model's shape")
        args = load_args_from(args_from)
        sd = load_consolidated_state_dict(state_dict, args)
    else:
        args, sd = load_full_state_dict(load, iteration)
        if args_from is not None:
            args = load_args_from(args_from)
    cfg = model_config_from_args(args)
    model = to_hf_model(cfg, sd)
    print(f"> writing {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters) to {output}", flush=True)
    model.save_pretrained(output)
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", help="Megatron checkpoint directory (holds latest_checkpointed_iteration.txt)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    p.add_argument("--state-dict", help="full fp32 state dict file {name: tensor} (single-process names)")
    p.add_argument("--args-from", help="checkpoint directory or JSON file with the model args (for --state-dict)")
    p.add_argument("--output", required=True, help="Hugging Face model directory to write")
    a = p.parse_args(argv)
    try:
        convert(a.output, load=a.load, iteration=a.iteration, state_dict=a.state_dict, args_from=a.args_from)
    except CheckpointError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
