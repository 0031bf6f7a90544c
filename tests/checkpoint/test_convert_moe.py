"""Mixtral and Qwen2-MoE from and to Hugging Face: logits equal transformers' at EP 1 and at EP 2 x TP 2 /
EP 2 x PP 2 (the checkpoint loaded and saved again there); HF -> ours -> HF is exact."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

from megatron.core import parallel_state as ps
from megatron.core.moe.config import MoEConfig
from megatron.core.transformer_config import TransformerConfig
from megatron.model.gpt_model import GPTModel
from megatron.training.arguments.model import model_config_from_args as model_args
from megatron.training.arguments.parse import build_parser
from megatron.training.checkpoint.checkpointer import write_tracker
from megatron.training.checkpoint.layout import layout_function
from megatron.training.checkpoint.names import iteration_dir
from tests.checkpoint.hf_models import SEQ, VOCAB, hf_logits, hf_tokens, random_hf_model
from tests.dist_utils import run_distributed
from tools.checkpoint import convert_from_hf, convert_to_hf, hf_mapping
from tools.checkpoint.loader import expected_names, model_config_from_args, open_checkpoint, read_args
from zero_cache.checkpoint import CheckpointError, distributed
from zero_cache.checkpoint.interface import PARAM, StatePiece

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=SEQ, rms_norm_eps=1e-6, num_experts_per_tok=2)
HF_CONFIGS = {
    "mixtral": MixtralConfig(**_COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=4,
                             rope_theta=5000.0, tie_word_embeddings=False),
    # a dense layer (mlp_only_layers), QKV biases, top-k weights not renormalised, tied head
    "qwen2_moe": Qwen2MoeConfig(**_COMMON, intermediate_size=40, moe_intermediate_size=24,
                                shared_expert_intermediate_size=20, num_hidden_layers=4, num_experts=4,
                                mlp_only_layers=[1], norm_topk_prob=False, qkv_bias=True, tie_word_embeddings=True),
    # every second layer MoE (decoder_sparse_step), renormalised top-k, no biases
    "qwen2_moe-step2": Qwen2MoeConfig(**_COMMON, intermediate_size=40, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=20, num_hidden_layers=4, num_experts=4,
                                      decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False),
}


def _hf_model(name: str, path: str, **save):
    """A tiny random Hugging Face model, its routers spread out so that the top k are clear-cut."""
    return random_hf_model(HF_CONFIGS[name], path, lambda n: 1.0 if n.endswith("mlp.gate.weight") else 0.05, **save)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_equal_transformers_at_ep1(single_rank, tmp_path, name):
    hf = _hf_model(name, str(tmp_path / "hf"))
    flags = convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    args, ours = open_checkpoint(str(tmp_path / "ckpt"))
    cfg = model_config_from_args(args)
    assert cfg.moe is not None and cfg.moe.num_experts == 4 and cfg.moe.router_topk == 2
    model = GPTModel(cfg).eval()
    model.load_state_dict({n: ours(n) for n, _ in model.named_parameters()}, strict=True)
    with torch.no_grad():
        logits = model(hf_tokens(), torch.arange(SEQ).expand(2, -1))
    torch.testing.assert_close(logits[..., :VOCAB], hf_logits(hf), rtol=0, atol=1e-4)
    assert flags[flags.index("--num-experts") + 1] == "4"
    assert ("--moe-router-pre-softmax" in flags) == (name == "qwen2_moe")  # norm_topk_prob False
    assert ("--moe-shared-expert-gate" in flags) == name.startswith("qwen2_moe")
    assert ("--add-qkv-bias" in flags) == (name == "qwen2_moe")
    freq = {"mixtral": "1", "qwen2_moe": "[1,0,1,1]", "qwen2_moe-step2": "[0,1,0,1]"}[name]
    assert flags[flags.index("--moe-layer-freq") + 1] == freq


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_flags_build_the_same_model(tmp_path, name):
    """The printed flags, read by the trainer's own parser, give the model the checkpoint holds."""
    _hf_model(name, str(tmp_path / "hf"))
    flags = convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    trainer = model_args(build_parser().parse_args(flags + ["--micro-batch-size", "1"]))
    cfg = model_config_from_args(read_args(str(tmp_path / "ckpt")))
    assert trainer.moe == cfg.moe
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "kv_channels", "swiglu",
                "add_bias_linear", "add_qkv_bias", "normalization", "rotary_base", "layernorm_epsilon",
                "untie_embeddings_and_output_weights"):
        assert getattr(trainer, key) == getattr(cfg, key), key


class _Weights:
    """This rank's parameters as a checkpoint source, without an optimizer (enough to load and save weights)."""

    def __init__(self, model):
        self.model, self.params = model, dict(model.named_parameters())

    def state_pieces(self):
        return [StatePiece(n, tuple(p.shape), 0, p.numel()) for n, p in self.params.items()]

    def read_state(self, piece, state, lo, hi):
        assert state == PARAM
        return self.params[piece.name].detach().view(-1)[lo:hi]

    def write_state(self, piece, state, lo, values):
        with torch.no_grad():
            self.params[piece.name].view(-1)[lo:lo + values.numel()].copy_(values.reshape(-1))

    def replicated_tensors(self):
        return {n: b for n, b in self.model.state_dict(keep_vars=True).items() if n not in self.params}

    def training_state(self):
        return {"optimizer_step": 0, "loss_scaler": None}

    def load_training_state(self, state, load_optimizer):
        pass

    def states_loaded(self):
        pass


def _expert_parallel_logits(rank, world, ckpt, resaved, hf_dir, tp, pp):
    """EP 2 with TP or PP 2 on 4 ranks: load the checkpoint, compute logits, save it again from this mesh."""
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=2)
    args = read_args(ckpt)
    cfg = model_config_from_args(args)
    model = GPTModel(cfg).eval()
    weights, layout = _Weights(model), layout_function(model)
    distributed.load(iteration_dir(ckpt, 0), weights, layout=layout, optimizer=False)
    experts = model.decoder.layers[0].mlp.experts.linear_fc2.weight
    assert experts.shape[0] == 2  # two of the four experts on this rank
    ids, pos = hf_tokens(), torch.arange(SEQ).expand(2, -1)
    with torch.no_grad():
        if ps.is_pipeline_first_stage():
            out = model(ids, pos)
            if not ps.is_pipeline_last_stage():
                torch.distributed.send(out, ps.get_pipeline_model_parallel_next_rank())
        else:
            hidden = torch.empty(2, SEQ, cfg.hidden_size)
            torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
            out = model(ids, pos)
    distributed.save(iteration_dir(resaved, 0), weights, layout=layout, optimizer=False,
                     objects={"args": args, "iteration": 0})
    if not ps.is_pipeline_last_stage():
        return None
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    return out[..., :VOCAB], hf_logits(hf)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,tp,pp", [("qwen2_moe", 2, 1), ("mixtral", 1, 2)])
def test_logits_equal_transformers_at_ep2(tmp_path, name, tp, pp):
    _hf_model(name, str(tmp_path / "hf"))
    convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), tp=tp, pp=pp)
    outs = run_distributed(_expert_parallel_logits, 4, str(tmp_path / "ckpt"), str(tmp_path / "resaved"),
                           str(tmp_path / "hf"), tp, pp, timeout=180)
    last = [o for o in outs if o is not None]
    assert len(last) == 4 // pp
    for ours, theirs in last:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    # what EP 2 saved exports back to the very weights we started from
    write_tracker(str(tmp_path / "resaved"), 0)
    convert_to_hf.convert(str(tmp_path / "back"), load=str(tmp_path / "resaved"))
    _assert_same_weights(tmp_path / "hf", tmp_path / "back")


def _assert_same_weights(a, b):
    before, after = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert before.keys() == after.keys()
    for k, t in before.items():
        assert t.dtype == after[k].dtype and torch.equal(t, after[k]), k


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_to_ours_to_hf_is_bit_identical(tmp_path, name):
    _hf_model(name, str(tmp_path / "hf"))
    convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), divisible_by=64)
    assert convert_to_hf.convert(str(tmp_path / "back"), load=str(tmp_path / "ckpt")) == \
        type(HF_CONFIGS[name]).__name__.replace("Config", "ForCausalLM")
    _assert_same_weights(tmp_path / "hf", tmp_path / "back")
    a = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).config.to_dict()
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).config.to_dict()
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                "num_local_experts", "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
                "mlp_only_layers", "qkv_bias", "tie_word_embeddings", "rms_norm_eps", "rope_parameters",
                "router_aux_loss_coef", "head_dim", "sliding_window"):
        assert a.get(key) == b.get(key), key


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout_imports_the_same(tmp_path, name):
    """transformers 5's own layout (one [E, 2f, h] gate_up_proj per layer) converts to the same checkpoint."""
    _hf_model(name, str(tmp_path / "hf"))
    _hf_model(name, str(tmp_path / "fused"), save_original_format=False)
    assert any("gate_up_proj" in k for k in load_file(str(tmp_path / "fused" / "model.safetensors")))
    convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "a"))
    convert_from_hf.convert(str(tmp_path / "fused"), str(tmp_path / "b"))
    args, a = open_checkpoint(str(tmp_path / "a"))
    _, b = open_checkpoint(str(tmp_path / "b"))
    for n in expected_names(model_config_from_args(args)):
        assert torch.equal(a(n), b(n)), n


@pytest.mark.parametrize("name,change,field", [
    ("mixtral", {"sliding_window": 8}, "sliding_window"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "layer_types": None}, "use_sliding_window"),
])
def test_unsupported_config_fields_are_named(tmp_path, name, change, field):
    cfg = HF_CONFIGS[name].to_dict()
    cfg.update(change)
    AutoModelForCausalLM.from_config(type(HF_CONFIGS[name]).from_dict(cfg)).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=f"'{field}'"):
        convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_moe_designs_without_a_hugging_face_class_are_refused():
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=64,
                            position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                            add_bias_linear=False, moe=MoEConfig(num_experts=4))
    assert hf_mapping.model_family(cfg) == "mixtral"
    assert hf_mapping.model_family(dataclasses.replace(
        cfg, moe=MoEConfig(num_experts=4, shared_expert_intermediate_size=16, shared_expert_gate=True))) == "qwen2_moe"
    for moe, need in [(MoEConfig(num_experts=4, score_function="sigmoid"), "moe.score_function='softmax'"),
                      (MoEConfig(num_experts=4, layer_freq=2), "moe.layer_freq=1"),
                      (MoEConfig(num_experts=4, shared_expert_intermediate_size=16), "moe.shared_expert_gate=True")]:
        with pytest.raises(CheckpointError, match=f"matches neither Hugging Face Mixtral.*needs {need}"):
            hf_mapping.model_family(dataclasses.replace(cfg, moe=moe))
