"""The README's data path: sample corpus -> tokenizer training -> preprocessing -> datasets -> batches."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron.data import build_pretraining_data_loader, build_train_valid_test_datasets
from megatron.tokenizer import build_tokenizer
from megatron.training.arguments.data import add_data_args, data_config_from_args
from megatron.training.arguments.tokenizer import add_tokenizer_args, tokenizer_config_from_args
from tools import make_sample_corpus, preprocess_data, train_tokenizer

pytestmark = pytest.mark.multiprocess


def test_corpus_to_batches(tmp_path):
    corpus = str(tmp_path / "corpus.jsonl")
    make_sample_corpus.main(["--output", corpus, "--max-mb", "0.6"])
    train_tokenizer.main(["--input", corpus, "--vocab-size", "2048", "--output-dir", str(tmp_path / "tok")])
    tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "tok/vocab.json"),
                       "--merge-file", str(tmp_path / "tok/merges.txt")]
    preprocess_data.main(["--input", corpus, *tokenizer_flags, "--append-eod", "--workers", "2",
                          "--output-prefix", str(tmp_path / "data/sample")])
    parser = add_data_args(add_tokenizer_args(argparse.ArgumentParser()))
    args = parser.parse_args([*tokenizer_flags, "--data-path", str(tmp_path / "data/sample_text_document"),
                              "--split", "90,8,2"])
    tokenizer = build_tokenizer(tokenizer_config_from_args(args))
    train, valid, test = build_train_valid_test_datasets(data_config_from_args(args), tokenizer, 256,
                                                         (64, 16, 8), seed=1234)
    loader = build_pretraining_data_loader(train, 16, 4, 1, 2, num_workers=0)
    batch = next(iter(loader))["text"]
    assert batch.shape == (4, 257) and batch.dtype == torch.int64
    assert int(batch.max()) < tokenizer.vocab_size
    assert sum(int((train[i]["text"] == tokenizer.eod).sum()) for i in range(len(train))) > 0  # --append-eod
    text = tokenizer.detokenize(batch[0].tolist())
    assert sum(text.count(w) for w in (" the ", " of ", " a ")) > 3  # real English came through
    assert valid is not None and test is not None
