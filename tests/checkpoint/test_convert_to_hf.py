"""Reassembly of TP/PP checkpoints and the Hugging Face export, against a single-process GPTModel."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.legacy import save_checkpoint
from tests.checkpoint.common import CONFIGS, assert_same, build_trained, megatron_args, tokens
from tools.checkpoint import convert_to_hf, hf_mapping
from tools.checkpoint.loader import load_full_state_dict, model_config_from_args
from zero_cache.checkpoint import CheckpointError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_CLASS = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}
# Llama blocks with biases and a tied head: the other branch of every Llama mapping choice.
LLAMA_BIAS_TIED = dataclasses.replace(CONFIGS["llama"], add_bias_linear=True,
                                      untie_embeddings_and_output_weights=False, num_query_groups=1)


def _reference(cfg):
    """Our single-process model with the mesh-independent weights, and its logits on fixed tokens."""
    model, opt, sched = build_trained(cfg)
    model.eval()
    ids, pos = tokens(cfg)
    with torch.no_grad():
        return model, opt, sched, model(ids, pos)


def _hf_logits(path: str, cfg, family: str) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert type(hf) is HF_CLASS[family]
    with torch.no_grad():
        return hf(tokens(cfg)[0]).logits


def _save_single(cfg, root, model, opt, sched) -> str:
    save_checkpoint(CheckpointConfig(save=str(root), load=None, save_interval=None), 5, model, opt, sched,
                    consumed_samples=10, args=megatron_args(cfg, 1, 1, 1))
    return str(root)


@pytest.mark.parametrize("layout", ["tp2pp2", "tp2dp2", "single"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_gives_our_logits(single_rank, saved, tmp_path, family, layout):
    cfg = CONFIGS[family]
    ref, opt, sched, logits = _reference(cfg)
    root = _save_single(cfg, tmp_path / "ckpt", ref, opt, sched) if layout == "single" \
        else os.path.join(saved[0], layout, family)

    args, full = load_full_state_dict(root, progress=lambda msg: None)
    assert model_config_from_args(args) == dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    assert_same(ref.state_dict(), full)  # reassembled weights equal the single-process model's, bit for bit

    convert_to_hf.convert(str(tmp_path / "hf"), load=root)
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "hf"))
    torch.testing.assert_close(_hf_logits(str(tmp_path / "hf"), cfg, family), logits, rtol=0, atol=1e-4)


def test_hf_configs_carry_our_hyperparameters(single_rank, saved, tmp_path):
    convert_to_hf.convert(str(tmp_path / "gpt2"), load=os.path.join(saved[0], "tp2pp2", "gpt2"))
    convert_to_hf.convert(str(tmp_path / "llama"), load=os.path.join(saved[0], "tp2pp2", "llama"))
    gpt2 = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    llama = json.loads((tmp_path / "llama" / "config.json").read_text())
    got = (gpt2["activation_function"], gpt2["n_positions"], gpt2["vocab_size"], gpt2["n_inner"])
    assert got == ("gelu", 16, 64, 128)
    assert gpt2["tie_word_embeddings"] is True
    assert (llama["num_key_value_heads"], llama["head_dim"], llama["rms_norm_eps"]) == (2, 8, 1e-6)
    assert llama["rope_parameters"]["rope_theta"] == 5000.0 and llama["tie_word_embeddings"] is False


def test_llama_with_biases_and_tied_head(single_rank, tmp_path):
    ref, opt, sched, logits = _reference(LLAMA_BIAS_TIED)
    convert_to_hf.convert(str(tmp_path / "hf"), load=_save_single(LLAMA_BIAS_TIED, tmp_path / "ckpt", ref, opt, sched))
    torch.testing.assert_close(_hf_logits(str(tmp_path / "hf"), LLAMA_BIAS_TIED, "llama"), logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_consolidated_state_dict_input(single_rank, saved, tmp_path, family):
    """--state-dict: a full {name: tensor} file (what a ZeRO consolidation writes) with --args-from."""
    cfg = CONFIGS[family]
    ref, _, _, logits = _reference(cfg)
    torch.save({k: v.clone() for k, v in ref.state_dict().items()}, tmp_path / "full.pt")
    if family == "gpt2":
        args_from = tmp_path / "args.json"
        args_from.write_text(json.dumps(megatron_args(cfg, 1, 1, 1)))
    else:
        args_from = os.path.join(saved[0], "tp2pp2", family)  # a checkpoint directory's args
    convert_to_hf.convert(str(tmp_path / "hf"), state_dict=str(tmp_path / "full.pt"), args_from=str(args_from))
    torch.testing.assert_close(_hf_logits(str(tmp_path / "hf"), cfg, family), logits, rtol=0, atol=1e-4)

    wrong = dict(megatron_args(cfg, 1, 1, 1), num_layers=2)
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match="does not match the model arguments: missing \\[\\], unexpected"):
        convert_to_hf.convert(str(tmp_path / "x"), state_dict=str(tmp_path / "full.pt"),
                              args_from=str(tmp_path / "wrong.json"))


@pytest.mark.multiprocess
def test_command_line(saved, tmp_path):
    out = tmp_path / "hf"
    run = subprocess.run([sys.executable, os.path.join(REPO, "tools", "checkpoint", "convert_to_hf.py"),
                          "--load", os.path.join(saved[0], "tp2pp2", "gpt2"), "--iteration", "3", "--output", str(out)],
                         capture_output=True, text=True, cwd=str(tmp_path), timeout=300)
    assert run.returncode == 0, run.stderr
    assert "GPT2LMHeadModel" in run.stdout and (out / "model.safetensors").is_file()



def test_command_line_errors_name_the_problem(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert_to_hf.main(["--load", str(tmp_path / "none"), "--output", str(tmp_path / "x")])
    assert exit_info.value.code == 2 and "holds no complete checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_to_hf.main(["--state-dict", str(tmp_path / "full.pt"), "--output", str(tmp_path / "x")])
    assert "--state-dict needs --args-from" in capsys.readouterr().err


def test_unsupported_block_design_is_a_clear_error():
    cfg = dataclasses.replace(CONFIGS["gpt2"], normalization="RMSNorm")
    with pytest.raises(CheckpointError, match="matches neither Hugging Face GPT-2.*needs normalization='LayerNorm'"):
        hf_mapping.model_family(cfg)
    cfg = dataclasses.replace(CONFIGS["llama"], swiglu=False)
    with pytest.raises(CheckpointError, match="needs swiglu=True"):
        hf_mapping.model_family(cfg)
