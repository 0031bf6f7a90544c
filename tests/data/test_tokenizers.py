"""Tokenizers: our GPT-2 BPE against HF tokenizers, the other tokenizer types, flags and errors."""
from __future__ import annotations

import argparse
import json
import random

import pytest
import regex
from tokenizers import ByteLevelBPETokenizer, pre_tokenizers

from megatron.tokenizer import GPT2BPETokenizer, TokenizerConfig, build_tokenizer
from megatron.tokenizer.byte_level import (
    LETTER_CLASS,
    NUMBER_CLASS,
    OTHER_CLASS,
    Gpt2PreTokenizer,
    bytes_to_unicode,
    unicode16_pattern,
)
from megatron.training.arguments.tokenizer import add_tokenizer_args, tokenizer_config_from_args
from tests.data.conftest import MULTILINGUAL, varied_corpus, write_jsonl
from tools import train_tokenizer


def test_gpt2_bpe_ids_equal_hf_on_varied_unicode(bpe_files):
    vocab, merges = bpe_files
    ours = GPT2BPETokenizer(vocab, merges)
    hf = ByteLevelBPETokenizer(vocab, merges)
    texts = varied_corpus(seed=1, n_random=400)  # a different random draw than the training corpus
    compared = 0
    for text in texts:
        ids = ours.tokenize(text)
        assert ids == hf.encode(text).ids, text[:80]
        assert ours.detokenize(ids) == hf.decode(ids) == text
        compared += len(ids)
    assert compared > 20_000
    # the cache must not change results: a second pass hits it
    assert [ours.tokenize(t) for t in texts[:50]] == [hf.encode(t).ids for t in texts[:50]]
    assert ours.vocab_size == hf.get_vocab_size() and ours.eod == hf.token_to_id("<|endoftext|>")


def test_pretokenizer_matches_hf_for_every_code_point():
    """Every code point is a letter, number, space or other symbol for us exactly when it is for HF.

    Code points are grouped by our class, each preceded by a character of that class ('a', '1', ' ',
    '!'), so when HF agrees a group stays one piece, and any disagreement splits it: the piece lists
    differ. The code points in natural order are compared as well.
    """
    hf = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ours = Gpt2PreTokenizer()
    byte_map = str.maketrans({chr(b): c for b, c in bytes_to_unicode().items()})
    everything = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    letters = regex.findall(LETTER_CLASS, everything, flags=regex.VERSION1)
    numbers = regex.findall(NUMBER_CLASS, everything, flags=regex.VERSION1)
    spaces = regex.findall(r"\s", everything)
    others = regex.findall(OTHER_CLASS, everything, flags=regex.VERSION1)
    assert len(letters) + len(numbers) + len(spaces) + len(others) == len(everything)
    texts = ["".join("a" + c for c in letters), "".join("1" + c for c in numbers),
             "".join(" " + c for c in spaces), "".join("!" + c for c in others), everything]
    for text in texts:
        expected = [piece for piece, _ in hf.pre_tokenize_str(text)]
        got = [p.encode("utf-8").decode("latin-1").translate(byte_map) for p in ours.split(text)]
        assert got == expected


def test_unicode17_letters_take_the_exact_path_and_match_hf(bpe_files):
    ours = GPT2BPETokenizer(*bpe_files)
    hf = ByteLevelBPETokenizer(*bpe_files)
    text = "abc\u0558def \U0003D000x 1\U00011DE02 plain"  # Unicode 17 letters / digits among ASCII
    assert Gpt2PreTokenizer().split(text) == unicode16_pattern().findall(text)
    assert ours.tokenize(text) == hf.encode(text).ids


def test_merges_file_errors(tmp_path, bpe_files):
    vocab, _ = bpe_files
    bad = tmp_path / "merges.txt"
    bad.write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt:2"):
        GPT2BPETokenizer(vocab, bad)
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({"a": 0, "b": 1}), encoding="utf-8")
    bad.write_text("#version: 0.2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        GPT2BPETokenizer(no_eod, bad)


def _parse(argv):
    return tokenizer_config_from_args(add_tokenizer_args(argparse.ArgumentParser()).parse_args(argv))


def test_build_tokenizer_errors_name_the_flag(tmp_path, bpe_files):
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer(_parse(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe_files[0]]))
    with pytest.raises(FileNotFoundError, match="--vocab-file .*nope.json"):
        build_tokenizer(_parse(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "nope.json"),
                                "--merge-file", bpe_files[1]]))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer(TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer"))
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer"))
    with pytest.raises(ValueError, match="--tokenizer-type"):
        build_tokenizer(TokenizerConfig())


def test_null_tokenizer():
    tok = build_tokenizer(_parse(["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]))
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("5 17  99\n0") == [5, 17, 99, 0]
    assert tok.detokenize([5, 17]) == "5 17"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    rng = random.Random(3)
    corpus = write_jsonl(out / "corpus.jsonl", [{"text": " ".join(rng.sample(MULTILINGUAL, 5))} for _ in range(200)])
    train_tokenizer.main(["--input", corpus, "--type", "bpe", "--vocab-size", "600", "--output-dir", str(out / "bpe")])
    train_tokenizer.main(["--input", corpus, "--type", "sentencepiece", "--vocab-size", "1000",
                          "--output-dir", str(out / "sp")])
    return out


def test_trained_bpe_serves_gpt2_and_hf_tokenizers(trained_dir):
    gpt2 = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=str(trained_dir / "bpe/vocab.json"),
                                           merge_file=str(trained_dir / "bpe/merges.txt")))
    hf = build_tokenizer(TokenizerConfig("HFTokenizer", tokenizer_model=str(trained_dir / "bpe")))
    assert gpt2.vocab_size == hf.vocab_size == 600 and gpt2.eod == hf.eod == 0
    for text in MULTILINGUAL:
        ids = gpt2.tokenize(text)
        assert ids == hf.tokenize(text)
        assert gpt2.detokenize(ids) == hf.detokenize(ids) == text


def test_sentencepiece_tokenizers(trained_dir):
    model = str(trained_dir / "sp/tokenizer.model")
    gpt = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", tokenizer_model=model))
    assert gpt.vocab_size == 1000 and gpt.eod == 2
    text = "The quick brown fox. Привет, мир!"
    ids = gpt.tokenize(text)
    assert all(0 <= i < 1000 for i in ids) and gpt.detokenize(ids) == text
    meg = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer_model=model))
    # Megatron adds <CLS> <SEP> <EOD> <MASK> after the model's pieces (pad/bos/eos exist already)
    assert meg.vocab_size == 1004 and meg.eod == 1002
    ids = meg.tokenize("hello<EOD>world<SEP>")
    assert ids == gpt.tokenize("hello") + [1002] + gpt.tokenize("world") + [1001]
    assert meg.detokenize(ids) == "hello <EOD> world <SEP> "
