"""Real Megatron-LM / Megatron-DeepSpeed launch scripts' flag sets parse here as they are (but for paths and sizes),
resolve to what those flags mean, train 3 iterations on 2 gloo ranks, and what is refused is one line naming the
flag; every flag they use has its row in docs/megatron-compat.md."""
from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch

from megatron.training.arguments import ConfigError, parse_args
from megatron.training.attention_backend import AttentionBackendError, attention_backend
from tests.training import megatron_scripts
from tests.training.megatron_scripts import (
    ITERS,
    LLAMA3_DECOUPLED_LR,
    LLAMA3_FP8,
    REFUSED_IN_SCRIPTS,
    ROOT,
    SCRIPTS,
    gpt3_175b,
    llama3_8b,
    mds_gpt_125m,
    mds_llama2,
    mds_moe_dense_1_3b,
)
from tests.training.run_trainer import losses, run
from tools import make_sample_corpus, preprocess_data, train_tokenizer

HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module", autouse=True)
def sample_corpus(tmp_path_factory):
    """A small corpus of the bundled sample's kind, made here: a fresh clone has no data/sample (examples/start.sh
    builds that one), and another test may be building it at the same time."""
    out = tmp_path_factory.mktemp("sample")
    corpus = str(out / "corpus.jsonl")
    make_sample_corpus.main(["--output", corpus, "--max-mb", "0.6"])
    train_tokenizer.main(["--input", corpus, "--vocab-size", "2048", "--output-dir", str(out)])
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(out / "vocab.json"),
                 "--merge-file", str(out / "merges.txt")]
    preprocess_data.main(["--input", corpus, *tokenizer, "--append-eod", "--workers", "1",
                          "--output-prefix", str(out / "corpus")])
    with pytest.MonkeyPatch.context() as patch:  # the scripts' argv builders read these when called
        patch.setattr(megatron_scripts, "CORPUS", str(out / "corpus_text_document"))
        patch.setattr(megatron_scripts, "VOCAB", str(out / "vocab.json"))
        patch.setattr(megatron_scripts, "MERGES", str(out / "merges.txt"))
        yield


def _cpu_llama3(tmp_path):
    """The llama3 script's fused attention exists on CUDA only; on a CPU machine torch picks (auto)."""
    return llama3_8b(tmp_path, "fused" if torch.cuda.is_available() else "auto")


def _argv(name, tmp_path):
    return _cpu_llama3(tmp_path) if name == "llama3_8b" else SCRIPTS[name][0](tmp_path)


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n != "mds_llama2"])
def test_script_flags_parse_to_three_iterations(name, tmp_path):
    cfg = parse_args(_argv(name, tmp_path), world_size=SCRIPTS[name][1])
    assert cfg.train.train_iters == ITERS


def test_the_flags_resolve_to_what_they_mean(tmp_path):
    cfg = parse_args(gpt3_175b(tmp_path), world_size=2)  # "0:4 64:8": 64 tokens = 4 samples of 16
    assert [cfg.parallel.schedule.global_batch_size(c) for c in (0, 3, 4)] == [4, 4, 8]
    assert (cfg.scheduler.lr_decay_steps, cfg.scheduler.lr_warmup_steps) == (30 * 8, pytest.approx(0.24))
    cfg = parse_args(gpt3_175b(tmp_path, ramp=True), world_size=2)  # 4 -> 8 in steps of 4 over 8 samples
    assert [cfg.parallel.schedule.global_batch_size(c) for c in (0, 4, 8, 9)] == [4, 4, 8, 8]
    assert cfg.tokenizer.tokenizer_type == "GPT2BPETokenizer"  # --vocab-file with --merge-file, no type given

    cfg = parse_args(_cpu_llama3(tmp_path), world_size=2)
    assert cfg.zero_cache is not None and cfg.zero_cache.zero_optimization.stage == 1  # --use-distributed-optimizer
    assert (cfg.scheduler.lr_warmup_steps, cfg.scheduler.lr_decay_steps) == (4, 12)  # samples
    assert cfg.data.split == "99,1,0" and cfg.model.position_embedding_type == "rope"
    assert cfg.housekeeping.manual_gc and cfg.housekeeping.empty_unused_memory_level == 1

    cfg = parse_args(mds_gpt_125m(tmp_path), world_size=2)
    assert cfg.zero_cache.zero_optimization.stage == 1 and cfg.parallel.pipeline_model_parallel_size == 2
    assert (cfg.scheduler.lr_decay_steps, cfg.scheduler.lr_warmup_steps) == (480 // 16, 48 // 16)  # tokens / seq
    assert cfg.scheduler.override_opt_param_scheduler and cfg.log.tensorboard_queue_size == 1
    flash = parse_args(mds_gpt_125m(tmp_path) + ["--use-flash-attn"], world_size=2)  # ds_pretrain_gpt_125M_flashattn
    assert flash.model.attention_backend == "flash"

    cfg = parse_args(mds_moe_dense_1_3b(tmp_path), world_size=2)
    assert cfg.zero_cache is None  # ZeRO stage 0: Megatron DDP
    assert cfg.parallel.schedule.samples_after(ITERS) == 2 + 2 + 4 and cfg.scheduler.lr_decay_steps == 960 // 16


def test_mds_llama2_flags(tmp_path):
    argv = mds_llama2(tmp_path)
    if not HAVE_WANDB:
        with pytest.raises(ConfigError, match="--wandb-project needs the wandb package.*pip install wandb"):
            parse_args(argv, world_size=2)
        return
    cfg = parse_args(argv, world_size=2)
    m = cfg.model
    assert (m.position_embedding_type, m.normalization, m.num_query_groups, m.recompute_granularity) == \
        ("rope", "RMSNorm", 2, "full")
    assert cfg.zero_cache is None and cfg.deepspeed.enabled  # --deepspeed with --zero-stage=0
    assert (cfg.log.wandb_project, cfg.log.wandb_exp_name) == ("pretrain-llama2", "exp0")


@pytest.mark.parametrize("flags, message", REFUSED_IN_SCRIPTS, ids=[m.split(":")[0] for _, m in REFUSED_IN_SCRIPTS])
def test_refused_flags_are_one_line_naming_the_flag(flags, message, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(mds_gpt_125m(tmp_path) + flags, world_size=2)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_llama3_script_as_shipped_is_refused_for_its_fp8_flags(tmp_path):
    with pytest.raises(ConfigError, match=r"^--fp8-format: FP8 training \(Transformer Engine\) is not implemented "
                                          r"here; train in --bf16"):
        parse_args(_cpu_llama3(tmp_path) + LLAMA3_FP8 + LLAMA3_DECOUPLED_LR, world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fused kernels exist on CUDA")
def test_an_attention_kernel_missing_here_is_one_line():
    with pytest.raises(AttentionBackendError, match=r"^--attention-backend fused: torch has no such attention kernel "
                                                    r"for torch.float32 with head size 16 on cpu .*use "
                                                    r"--attention-backend auto"):
        attention_backend("fused", torch.device("cpu"), torch.float32, 16)
    with attention_backend("unfused", torch.device("cpu"), torch.float32, 16):
        pass


def _documented_flags() -> set[str]:
    text = (ROOT / "docs" / "megatron-compat.md").read_text()
    return set(re.findall(r"`(--[a-zA-Z][\w-]*)", text))


def test_every_script_flag_has_a_row_in_the_compat_doc(tmp_path):
    flags = {a.split("=")[0] for name in SCRIPTS for a in _argv(name, tmp_path) if a.startswith("--")}
    flags |= {a for refused, _ in REFUSED_IN_SCRIPTS for a in refused if a.startswith("--")}
    flags |= set(LLAMA3_FP8[::2]) | {"--use-flash-attn"}
    missing = sorted(flags - _documented_flags())
    assert not missing, missing


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_trains_three_iterations(name, tmp_path, monkeypatch):
    """Under torchrun, as the scripts launch it (their data loader workers need a process of their own)."""
    if name == "mds_llama2" and not HAVE_WANDB:
        pytest.skip("its W&B flags need: pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, out = run(_argv(name, tmp_path), nproc=SCRIPTS[name][1], timeout=300)
    assert code == 0, out
    printed = losses(out)
    assert sorted(printed) == list(range(1, ITERS + 1)) and all(math.isfinite(v) for v in printed.values()), out
