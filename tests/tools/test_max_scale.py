"""benchmarks/max_scale.py: its size <-> layers arithmetic is the model's own parameter count, the report table
states ratios from the attempts it is given, and raw files go to the log folder, not to the results; the
benchmarks are a package that imports without sys.path edits."""
from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

from benchmarks import max_scale
from megatron.core.transformer_config import TransformerConfig


def _count(layers: int) -> int:
    cfg = TransformerConfig(num_layers=layers, hidden_size=max_scale.HIDDEN, num_attention_heads=max_scale.HEADS,
                            ffn_hidden_size=max_scale.FFN, seq_length=max_scale.SEQ,
                            padded_vocab_size=max_scale.VOCAB, untie_embeddings_and_output_weights=True)
    return cfg.num_parameters()


def test_params_of_layers_is_the_model_count():
    for layers in (1, 18, 69):
        assert max_scale.params_of(layers) == _count(layers)


def test_recorded_sizes_map_to_their_layer_counts():
    # The recorded DeepSpeed capacity attempts: 0.74B, 1.04B, 1.54B, 1.79B; and 3.6B.
    assert [max_scale.layers_for(b) for b in (0.74, 1.04, 1.54, 1.79, 3.6)] == [12, 18, 28, 33, 69]
    assert abs(max_scale.params_of(69) / 1e9 - 3.607) < 1e-3


def test_table_ratios():
    ours = [max_scale.Attempt("ours", "nvme", 69, max_scale.params_of(69), ok=True, step_s=[300.0, 200.0, 220.0],
                              peak_mem_gib=18.0, peak_disk_gib=41.0, peak_rss_gib=9.97)]
    ds = [{"offload": "nvme", "layers": 33, "params": max_scale.params_of(33), "ok": True, "s_per_step": "240",
           "peak_mem_gib": 22.4, "disk_gib": 36, "source": "cached"}]
    compare = [max_scale.Attempt("ours", "nvme", 18, max_scale.params_of(18), ok=True, step_s=[90.0, 50.0, 60.0]),
               max_scale.Attempt("deepspeed", "nvme", 18, max_scale.params_of(18), ok=True,
                                 step_s=[150.0, 110.0, 130.0])]
    text = max_scale.table(ours, ds, compare)
    # s/step: the median of the steps after the first
    assert "| ours | nvme | 69 | 3.61 | yes | 210.0 | 18.0 | 9.97 | 41.0 |" in text
    assert "| 22.4 | - | 36 |" in text  # no per-rank RSS for DeepSpeed's cached attempts
    assert "ours 3.61B, DeepSpeed 1.79B (2.01x)" in text
    assert "| 2.18x |" in text  # median(110, 130) / median(50, 60)


def test_deepspeed_trains_on_the_trainers_vocabulary_and_batches():
    """The harness's mock tokens are the samples pretrain_gpt.py --mock-data reads, micro-batch by micro-batch and
    rank by rank (2 micro-batches per rank here), and the model's vocabulary is the trainer's padded one."""
    from benchmarks.peer_workers.harness import BenchSpec, synthetic_tokens
    from megatron.data import DataConfig, build_pretraining_data_loader, build_train_valid_test_datasets
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.config import TokenizerConfig
    from megatron.training.config import padded_vocab_size

    seq, world, micro, steps = 16, 2, 1, 3
    spec = BenchSpec(layers=1, hidden=8, heads=2, vocab=max_scale.MODEL_VOCAB, seq=seq, micro_batch=micro,
                     global_batch=4, steps=steps - 1, warmup=1, lr=max_scale.LR, weight_decay=max_scale.WEIGHT_DECAY,
                     clip_grad=max_scale.CLIP_GRAD, seed=max_scale.SEED, page_size=1, threads=1,
                     mock_data_vocab=max_scale.VOCAB)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=max_scale.VOCAB))
    assert padded_vocab_size(tokenizer.vocab_size, 128, 1) == spec.vocab
    train, _, _ = build_train_valid_test_datasets(DataConfig(mock_data=True), tokenizer, seq,
                                                  (steps * spec.global_batch, 0, 0), max_scale.SEED,
                                                  vocab_size=tokenizer.vocab_size)
    tokens, gas = synthetic_tokens(spec), spec.grad_accumulation(world)
    assert (tokens == tokenizer.eod).any()  # the trainer's documents end with eod
    for rank in range(world):
        batches = iter(build_pretraining_data_loader(train, 0, micro, rank, world, 0))
        for step in range(steps):
            for m in range(gas):
                first = (m * world + rank) * micro
                assert torch.equal(next(batches)["text"], tokens[step, first:first + micro])


def test_capacity_cache_reads_the_recorded_attempts_and_writes_to_the_log_folder(tmp_path):
    with open(max_scale.RECORDED_CACHE, encoding="utf-8") as f:
        recorded = json.load(f)
    assert max_scale.load_cache(str(tmp_path)) == recorded  # nothing rerun yet: the recorded attempts
    updated = {"attempts": recorded["attempts"][:1]}
    path = max_scale.save_cache(updated, str(tmp_path))
    assert os.path.dirname(path) == str(tmp_path)
    assert max_scale.load_cache(str(tmp_path)) == updated  # a rerun's cache wins from then on
    with open(max_scale.RECORDED_CACHE, encoding="utf-8") as f:
        assert json.load(f) == recorded  # the file in git is never rewritten


class _Stop(Exception):
    pass


def test_default_folders_tables_in_results_raw_files_in_logs(monkeypatch):
    made, seen = [], {}

    def load_cache(log_dir):
        seen["log_dir"] = log_dir
        raise _Stop  # nothing is run: only the folders the defaults name are looked at

    monkeypatch.setattr(max_scale, "load_cache", load_cache)
    monkeypatch.setattr(max_scale.os, "makedirs", lambda path, exist_ok=False: made.append(path))
    with pytest.raises(_Stop):
        max_scale.main(["--ours-sizes", "--compare-size", "0"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(max_scale.__file__)))
    assert os.path.join(root, "benchmarks", "results", "max_scale") in made
    logs = os.path.join(root, "benchmarks", "logs", "max_scale")
    assert logs in made and seen["log_dir"] == logs


def test_gitignore_keeps_the_logs_folder_out():
    root = os.path.dirname(os.path.dirname(os.path.abspath(max_scale.__file__)))
    with open(os.path.join(root, ".gitignore"), encoding="utf-8") as f:
        assert "/benchmarks/logs/" in f.read().split()


@pytest.mark.parametrize("name", ["zero3_vs_peers", "max_scale", "bench_ssd", "bench_trainer", "bench_data",
                                  "bench_overlap", "profile_overlap", "peer_workers.worker", "peer_workers.harness"])
def test_benchmarks_import_as_modules_without_path_edits(name):
    before = list(sys.path)
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__name__ == f"benchmarks.{name}"
    assert sys.path == before
