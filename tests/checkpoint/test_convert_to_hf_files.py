"""What the Hugging Face export writes besides the weights: the run's tokenizer, its special ids in config.json and
generation_config.json, plain file permissions; and a missing package is one line."""
import dataclasses
import json
import os
import random
import sys

import pytest
from transformers import AutoTokenizer

from megatron.tokenizer import TokenizerConfig, build_tokenizer
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.legacy import save_checkpoint
from tests.checkpoint.common import CONFIGS, build_trained, megatron_args
from tests.data.conftest import MULTILINGUAL, write_jsonl
from tools import train_tokenizer
from tools.checkpoint import convert_to_hf, hf_tokenizer
from zero_cache.checkpoint import CheckpointError

CFG = dataclasses.replace(CONFIGS["gpt2"], padded_vocab_size=1024)  # holds the trained vocabularies below
SAMPLES = MULTILINGUAL + ["hello<EOD>world<SEP> and <|endoftext|>", "  two  spaces\n\nand lines "]
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> str:
    """A directory with bpe/{vocab.json,merges.txt,tokenizer.json} and sp/tokenizer.model trained as
    examples/prepare_sample_data.sh trains the sample corpus' tokenizer."""
    out = tmp_path_factory.mktemp("tokenizers")
    rng = random.Random(3)
    corpus = write_jsonl(out / "corpus.jsonl", [{"text": " ".join(rng.sample(MULTILINGUAL, 5))} for _ in range(200)])
    train_tokenizer.main(["--input", corpus, "--type", "bpe", "--vocab-size", "600", "--output-dir", str(out / "bpe")])
    train_tokenizer.main(["--input", corpus, "--type", "sentencepiece", "--vocab-size", "1000",
                          "--output-dir", str(out / "sp")])
    return str(out)


def _checkpoint(root, tokenizer: TokenizerConfig, true_vocab_size: int | None = None) -> str:
    """A tiny trained model saved with ``tokenizer``'s flags and the vocabulary size it gave recorded in its args, as
    the trainer records them."""
    model, opt, sched = build_trained(CFG)
    if true_vocab_size is None and tokenizer.tokenizer_type is not None:
        true_vocab_size = build_tokenizer(tokenizer).vocab_size
    args = {**megatron_args(CFG, 1, 1, 1), **dataclasses.asdict(tokenizer), "true_vocab_size": true_vocab_size}
    save_checkpoint(CheckpointConfig(save=str(root), load=None, save_interval=None), 5, model, opt, sched,
                    consumed_samples=10, args=args)
    return str(root)


def _config_ids(out) -> tuple[dict, dict]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    return {k: config.get(k) for k in keys}, {k: generation.get(k) for k in keys}


def _assert_same_tokenizer(out, ours) -> None:
    hf = AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLES:
        assert hf(text)["input_ids"] == ours.tokenize(text), text
    assert len(hf) == ours.vocab_size and hf.eos_token_id == ours.eod
    ids = {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id, "pad_token_id": hf.pad_token_id}
    assert _config_ids(out) == (ids, ids)


def test_export_writes_the_tokenizer_the_run_recorded(single_rank, tmp_path, tokenizers, monkeypatch):
    """examples/start.sh records relative tokenizer paths; the export finds them from the working directory."""
    monkeypatch.chdir(tokenizers)
    recorded = TokenizerConfig("GPT2BPETokenizer", vocab_file="bpe/vocab.json", merge_file="bpe/merges.txt")
    convert_to_hf.convert(str(tmp_path / "hf"), load=_checkpoint(tmp_path / "ckpt", recorded))
    assert TOKENIZER_FILES <= set(os.listdir(tmp_path / "hf"))
    _assert_same_tokenizer(tmp_path / "hf", build_tokenizer(recorded))
    assert _config_ids(tmp_path / "hf")[0] == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).model_max_length == CFG.max_position_embeddings


def test_relative_paths_are_found_from_the_repository_root_too(tmp_path, monkeypatch):
    """examples/start.sh trains in the checkout with data/sample/... paths; the export may run elsewhere."""
    (tmp_path / "repo/data/sample").mkdir(parents=True)
    (tmp_path / "repo/data/sample/vocab.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setattr(hf_tokenizer, "REPOSITORY", str(tmp_path / "repo"))
    args = {"vocab_file": "data/sample/vocab.json", "merge_file": "data/sample/merges.txt"}
    assert hf_tokenizer.tokenizer_config(args, TokenizerConfig()) == TokenizerConfig(
        "GPT2BPETokenizer", vocab_file=str(tmp_path / "repo/data/sample/vocab.json"),
        merge_file="data/sample/merges.txt")  # not found anywhere: kept as recorded, for the warning to name
    replaced = hf_tokenizer.tokenizer_config(args, TokenizerConfig(merge_file="m.txt"))
    assert (replaced.vocab_file, replaced.merge_file) == (str(tmp_path / "repo/data/sample/vocab.json"), "m.txt")


@pytest.mark.parametrize("kind", ["HFTokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_tokenizer_models(single_rank, tmp_path, tokenizers, kind):
    model = os.path.join(tokenizers, "bpe" if kind == "HFTokenizer" else "sp/tokenizer.model")
    recorded = TokenizerConfig(kind, tokenizer_model=model)
    convert_to_hf.convert(str(tmp_path / "hf"), load=_checkpoint(tmp_path / "ckpt", recorded))
    _assert_same_tokenizer(tmp_path / "hf", build_tokenizer(recorded))
    if kind != "HFTokenizer":  # trained with pad / bos / eos = 0 / 1 / 2; Megatron's eod is its own <EOD>
        eos = 1002 if kind == "SentencePieceTokenizer" else 2
        assert _config_ids(tmp_path / "hf")[0] == {"bos_token_id": 1, "eos_token_id": eos, "pad_token_id": 0}


def test_moved_tokenizer_is_a_warning_and_the_flags_name_it(single_rank, tmp_path, tokenizers, capsys):
    gone = TokenizerConfig("GPT2BPETokenizer", vocab_file=str(tmp_path / "gone/vocab.json"),
                           merge_file=str(tmp_path / "gone/merges.txt"))
    ckpt = _checkpoint(tmp_path / "ckpt", gone, true_vocab_size=600)
    convert_to_hf.main(["--load", ckpt, "--output", str(tmp_path / "weights_only")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convert_to_hf.py: warning: no tokenizer exported: --vocab-file ")
    assert "gone/vocab.json: no such file" in err and "pass the export --vocab-file and --merge-file with the" in err
    files = set(os.listdir(tmp_path / "weights_only"))
    assert "model.safetensors" in files and not files & TOKENIZER_FILES
    assert _config_ids(tmp_path / "weights_only")[0]["eos_token_id"] is None

    convert_to_hf.main(["--load", ckpt, "--output", str(tmp_path / "hf"), "--vocab-file",
                        os.path.join(tokenizers, "bpe/vocab.json"), "--merge-file",
                        os.path.join(tokenizers, "bpe/merges.txt")])
    assert capsys.readouterr().err == ""
    moved = dataclasses.replace(gone, vocab_file=os.path.join(tokenizers, "bpe/vocab.json"),
                                merge_file=os.path.join(tokenizers, "bpe/merges.txt"))
    _assert_same_tokenizer(tmp_path / "hf", build_tokenizer(moved))

    # another tokenizer than the run's (its vocabulary size differs from the recorded one) is refused
    with pytest.raises(CheckpointError, match="does not fit the model, whose vocabulary has 600 ids"):
        convert_to_hf.convert(str(tmp_path / "x"), load=ckpt, tokenizer=TokenizerConfig(
            "GPTSentencePieceTokenizer", tokenizer_model=os.path.join(tokenizers, "sp/tokenizer.model")))


def test_null_tokenizer_gives_its_eos_id(single_rank, tmp_path, capsys):
    convert_to_hf.convert(str(tmp_path / "hf"), load=_checkpoint(tmp_path / "ckpt", TokenizerConfig(
        "NullTokenizer", vocab_size=1000)))
    assert "no text vocabulary" in capsys.readouterr().err
    assert _config_ids(tmp_path / "hf")[0]["eos_token_id"] == 1000
    assert not set(os.listdir(tmp_path / "hf")) & TOKENIZER_FILES


def test_exported_files_get_the_permissions_of_a_plain_open(single_rank, tmp_path, tokenizers):
    recorded = TokenizerConfig("GPT2BPETokenizer", vocab_file=os.path.join(tokenizers, "bpe/vocab.json"),
                               merge_file=os.path.join(tokenizers, "bpe/merges.txt"))
    ckpt = _checkpoint(tmp_path / "ckpt", recorded)
    old = os.umask(0o022)
    try:
        convert_to_hf.convert(str(tmp_path / "one"), load=ckpt)
        convert_to_hf.convert(str(tmp_path / "sharded"), load=ckpt, max_shard_size="40KB")
    finally:
        os.umask(old)
    files = {out: os.listdir(tmp_path / out) for out in ("one", "sharded")}
    assert "model.safetensors" in files["one"] and len([f for f in files["sharded"] if "-of-" in f]) > 1
    for out, names in files.items():
        modes = {name: oct(os.stat(tmp_path / out / name).st_mode & 0o777) for name in names}
        assert set(modes.values()) == {"0o644"}, modes


def test_a_missing_package_is_one_line_naming_it(single_rank, tmp_path, monkeypatch, capsys):
    ckpt = _checkpoint(tmp_path / "ckpt", TokenizerConfig())
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if it were not installed
    with pytest.raises(SystemExit) as exit_info:
        convert_to_hf.main(["--load", ckpt, "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith("convert_to_hf.py: error: the Python package "
                                                           "'safetensors' is not installed; install the requirements: "
                                                           "pip install -r ")
    assert err[-1].endswith("requirements.txt") and "Traceback" not in "".join(err)
