"""Hugging Face -> our checkpoint: logits equal transformers' at TP 1 and TP 2 x PP 2; HF -> ours -> HF is exact."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.model.gpt_model import GPTModel
from megatron.training.checkpoint.ddp_states import DataParallelStates
from megatron.training.checkpoint.layout import layout_function
from megatron.training.checkpoint.names import iteration_dir
from tests.checkpoint.hf_models import SEQ, VOCAB, hf_logits, hf_tokens, random_hf_model
from tests.dist_utils import run_distributed
from tools.checkpoint import convert_from_hf, convert_to_hf
from tools.checkpoint.loader import model_config_from_args, open_checkpoint, read_args
from zero_cache.checkpoint import CheckpointError, distributed

HF_CONFIGS = {
    "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0),  # activation gelu_new: --openai-gelu
    "llama-gqa": LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False),
    "llama-bias-tied": LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                                   attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}


def _hf_model(name: str, path: str):
    return random_hf_model(HF_CONFIGS[name], path)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_equal_transformers_at_tp1(single_rank, tmp_path, name):
    hf = _hf_model(name, str(tmp_path / "hf"))
    flags = convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "model_flags.txt").read_text().split() == flags
    args, ours = open_checkpoint(str(tmp_path / "ckpt"))
    cfg = model_config_from_args(args)
    model = GPTModel(cfg).eval()
    model.load_state_dict({n: ours(n) for n, _ in model.named_parameters()}, strict=True)
    ids = hf_tokens()
    with torch.no_grad():
        logits = model(ids, torch.arange(SEQ).expand(2, -1))
    assert logits.shape[-1] == cfg.padded_vocab_size == 128  # padded for TP 1 and 128
    torch.testing.assert_close(logits[..., :VOCAB], hf_logits(hf), rtol=0, atol=1e-4)
    assert ("--openai-gelu" in flags) == (name == "gpt2")
    assert ("--group-query-attention" in flags) == (name == "llama-gqa")


def _pipeline_logits(rank, world, ckpt, hf_dir):
    """TP 2 x PP 2: the stage loads its slices of the checkpoint; stage 0 sends its hidden states to stage 1."""
    ps.initialize_model_parallel(2, 2)
    args = read_args(ckpt)
    cfg = model_config_from_args(args)
    model = GPTModel(cfg)
    ddp = DistributedDataParallel(model, ps.get_data_parallel_group())
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [ddp], ps.get_data_parallel_group(),
                                 ps.get_model_parallel_group())
    distributed.load(iteration_dir(ckpt, 0), DataParallelStates(model, opt), layout=layout_function(model),
                     optimizer=False)
    model.eval()
    ids, pos = hf_tokens(), torch.arange(SEQ).expand(2, -1)
    with torch.no_grad():
        if ps.is_pipeline_first_stage():
            torch.distributed.send(model(ids, pos), ps.get_pipeline_model_parallel_next_rank())
            return None
        hidden = torch.empty(2, SEQ, cfg.hidden_size)
        torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
        logits = model(ids, pos)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    return logits[..., :VOCAB], hf_logits(hf)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_logits_equal_transformers_at_tp2_pp2(tmp_path, name):
    _hf_model(name, str(tmp_path / "hf"))
    convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), tp=2, pp=2)
    outs = run_distributed(_pipeline_logits, 4, str(tmp_path / "ckpt"), str(tmp_path / "hf"), timeout=180)
    last = [o for o in outs if o is not None]
    assert len(last) == 2  # both tensor-parallel ranks of the last stage
    for ours, theirs in last:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_to_ours_to_hf_is_bit_identical(tmp_path, name):
    _hf_model(name, str(tmp_path / "hf"))
    convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), divisible_by=64)
    convert_to_hf.convert(str(tmp_path / "back"), load=str(tmp_path / "ckpt"))
    before = load_file(os.path.join(tmp_path / "hf", "model.safetensors"))
    after = load_file(os.path.join(tmp_path / "back", "model.safetensors"))
    assert before.keys() == after.keys()
    for k, t in before.items():
        assert t.dtype == after[k].dtype and torch.equal(t, after[k]), k
    a = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).config.to_dict()
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).config.to_dict()
    for key in ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
                "num_attention_heads", "num_key_value_heads", "intermediate_size", "activation_function",
                "tie_word_embeddings", "rms_norm_eps", "layer_norm_epsilon", "attention_bias", "head_dim"):
        assert a.get(key) == b.get(key), key


@pytest.mark.parametrize("name,change,field", [
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("llama-gqa", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("llama-gqa", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama-bias-tied", {"mlp_bias": False}, "attention_bias/mlp_bias"),
])
def test_unsupported_config_fields_are_named(tmp_path, name, change, field):
    cfg = HF_CONFIGS[name].to_dict()
    cfg.update(change)
    config = type(HF_CONFIGS[name]).from_dict(cfg)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=f"'{field}'"):
        convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()  # nothing written


def test_other_architectures_are_refused(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "bert", "hidden_size": 8}')
    with pytest.raises(CheckpointError, match="'model_type'"):
        convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
