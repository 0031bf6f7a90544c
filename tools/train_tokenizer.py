"""Train a tokenizer from JSONL, for users without downloaded vocabulary files.

    # GPT-2 style byte-level BPE: writes OUT/vocab.json, OUT/merges.txt (and OUT/tokenizer.json)
    python tools/train_tokenizer.py --input corpus.jsonl --type bpe --vocab-size 8192 --output-dir tok/
    #   then: --tokenizer-type GPT2BPETokenizer --vocab-file tok/vocab.json --merge-file tok/merges.txt
    # SentencePiece: writes OUT/tokenizer.model (and .vocab)
    python tools/train_tokenizer.py --input corpus.jsonl --type sentencepiece --vocab-size 8000 --output-dir tok/
    #   then: --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok/tokenizer.model

Text is streamed from the JSONL (``.gz`` and globs allowed); SentencePiece samples at most
``--max-sentences`` lines (it holds its sample in memory). Output files are written under temporary
names and renamed when training succeeded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sentencepiece  # noqa: E402
from tokenizers import ByteLevelBPETokenizer  # noqa: E402

from megatron.data.preprocess.jsonl_reader import expand_inputs, plan_partitions, read_chunks  # noqa: E402
from tools.tool_errors import one_line_errors  # noqa: E402

EOD_TOKEN = "<|endoftext|>"


def iter_texts(patterns: list[str], json_keys: list[str]) -> Iterator[str]:
    """The ``json_keys`` strings of every line, in input order; malformed lines are errors naming the line, and
    so is an input without any text."""
    found = False
    for segment in plan_partitions(expand_inputs(patterns), 1)[0]:
        for chunk in read_chunks([segment]):
            for i, line in enumerate(chunk.data.split(b"\n")):
                if not line.strip():
                    continue
                where = f"{chunk.path}:{chunk.first_line + i + 1}"
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{where}: invalid JSON ({e})") from None
                for key in json_keys:
                    if not isinstance(record, dict) or not isinstance(record.get(key), str):
                        raise ValueError(f"{where}: key {key!r} missing or not a string (see --json-keys)")
                    found = found or bool(record[key].strip())
                    yield record[key]
    if not found:
        raise ValueError(f"--input {' '.join(patterns)} holds no text under --json-keys {' '.join(json_keys)}; "
                         f"give JSONL files with documents")


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int, output_dir: str) -> list[str]:
    """Byte-level BPE with GPT-2's pre-tokenisation and <|endoftext|>; GPT-2 style vocab.json + merges.txt."""
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    # The trainer's progress bar redraws a terminal line; elsewhere (a pipe, a log) it leaves only blank lines.
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOD_TOKEN], show_progress=sys.stderr.isatty())
    with tempfile.TemporaryDirectory(dir=output_dir) as tmp:
        tokenizer.save_model(tmp)
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        names = ["vocab.json", "merges.txt", "tokenizer.json"]
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    return [os.path.join(output_dir, n) for n in names]


def train_sentencepiece(texts: Iterator[str], vocab_size: int, model_type: str, max_sentences: int,
                        output_dir: str) -> list[str]:
    """A SentencePiece model with pad/bos/eos/unk ids 0..3 (eos is GPTSentencePieceTokenizer's eod).

    SentencePiece trains on sentences, so each non-empty line of the texts is one training sentence.
    """
    input_errors: list[ValueError] = []

    def sentences() -> Iterator[str]:
        try:
            yield from (line for t in texts for line in t.split("\n") if line.strip())
        except ValueError as e:  # sentencepiece would wrap it in its own error; keep the original
            input_errors.append(e)
            raise

    with tempfile.TemporaryDirectory(dir=output_dir) as tmp:
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=sentences(), model_prefix=os.path.join(tmp, "tokenizer"),
                vocab_size=vocab_size, model_type=model_type, input_sentence_size=max_sentences,
                shuffle_input_sentence=True, character_coverage=0.9995, byte_fallback=True,
                pad_id=0, bos_id=1, eos_id=2, unk_id=3, max_sentence_length=1 << 16, minloglevel=1)
        except RuntimeError:
            if input_errors:
                raise input_errors[0] from None
            raise
        names = ["tokenizer.model", "tokenizer.vocab"]
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    return [os.path.join(output_dir, n) for n in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="JSONL files (.gz allowed) or globs")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is used")
    parser.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe",
                        help="bpe: GPT-2 byte-level BPE (GPT2BPETokenizer); sentencepiece: a .model file")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size, special tokens included")
    parser.add_argument("--min-frequency", type=int, default=2, help="bpe: least count of a merged pair")
    parser.add_argument("--sentencepiece-model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--max-sentences", type=int, default=2_000_000,
                        help="sentencepiece: most lines sampled into memory for training")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    if args.vocab_size < 260:
        parser.error(f"--vocab-size {args.vocab_size} is too small: byte-level vocabularies start at 257")
    with one_line_errors("train_tokenizer.py", "give existing JSONL files and a writable --output-dir", RuntimeError):
        os.makedirs(args.output_dir, exist_ok=True)
        texts = iter_texts(args.input, args.json_keys)
        if args.type == "bpe":
            files = train_bpe(texts, args.vocab_size, args.min_frequency, args.output_dir)
            use = (f"--tokenizer-type GPT2BPETokenizer --vocab-file {files[0]} --merge-file {files[1]}  "
                   f"(or --tokenizer-type HFTokenizer --tokenizer-model {files[2]})")
        else:
            files = train_sentencepiece(texts, args.vocab_size, args.sentencepiece_model_type,
                                        args.max_sentences, args.output_dir)
            use = f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {files[0]}"
    print(f"wrote {', '.join(files)}\nuse with: {use}")


if __name__ == "__main__":
    main()
