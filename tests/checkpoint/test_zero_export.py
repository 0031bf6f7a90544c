"""A trained ZeRO-3 checkpoint consolidates (streaming) to the trained fp32 weights; its HF export gives our logits."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron.model.gpt_model import GPTModel
from tests.training.parallel_harness import LLAMA_STYLE, TINY_GPT, ds_config_flags, train
from tools.checkpoint.convert_to_hf import convert
from tools.checkpoint.loader import model_config_from_args
from tools.checkpoint.zero_to_fp32 import zero_to_fp32
from zero_cache.checkpoint.consolidate import load_consolidated

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("extra, mesh", [
    ([], ["--pipeline-model-parallel-size", "2"]),  # tied embedding across stages
    (LLAMA_STYLE, ["--tensor-model-parallel-size", "2"]),  # tensor-parallel shards joined
], ids=["gpt2-pp2dp2", "llama-tp2dp2"])
def test_zero3_checkpoint_consolidates_to_trained_weights(single_rank, tmp_path, extra, mesh):
    save = ["--save", str(tmp_path / "ckpt"), "--train-iters", "3"]
    argv = [a for a in TINY_GPT] + extra + mesh + ds_config_flags(tmp_path, 3) + save
    _, trained, _ = train(argv, 4)
    out = tmp_path / "fp32"
    zero_to_fp32(str(tmp_path / "ckpt"), str(out))
    state = load_consolidated(str(out))
    assert state.keys() == trained.keys()
    for name, t in trained.items():
        torch.testing.assert_close(state[name], t, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    convert(str(tmp_path / "hf"), state_dict=str(out))  # args come from out/args.json
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    args = json.loads((out / "args.json").read_text())
    cfg = model_config_from_args(args)
    ours = GPTModel(cfg).eval()
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, 100, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ours(ids, torch.arange(cfg.seq_length).expand(2, -1))
        # The export keeps the tokenizer's vocabulary, without our padding rows.
        assert hf.config.vocab_size == args["true_vocab_size"] < cfg.padded_vocab_size
        torch.testing.assert_close(hf(ids).logits, ref[..., :args["true_vocab_size"]], rtol=0, atol=1e-4)
