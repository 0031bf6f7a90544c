"""Tokenizer flags (Megatron names), the typed config built from them, and ``build_tokenizer``."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import GPTSentencePieceTokenizer, SentencePieceTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "HFTokenizer", "NullTokenizer")


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                       help="which tokenizer to use (the files it needs are given by the flags below)")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece(GPT)Tokenizer: the .model file; HFTokenizer: tokenizer.json or its folder")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer: number of text ids (eod is the next id)")
    return parser


@dataclass(frozen=True)
class TokenizerConfig:
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None


def tokenizer_config_from_args(args: argparse.Namespace) -> TokenizerConfig:
    return TokenizerConfig(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                           vocab_size=args.vocab_size)


def _require_file(value: str | None, flag: str, tokenizer_type: str, allow_dir: bool = False) -> str:
    if value is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    path = Path(value)
    if not (path.is_file() or (allow_dir and path.is_dir())):
        raise FileNotFoundError(f"{flag} {value}: no such file (needed by --tokenizer-type {tokenizer_type})")
    return value


def build_tokenizer(cfg: TokenizerConfig) -> MegatronTokenizer:
    """The tokenizer ``cfg`` names; a missing flag or file is an error naming the flag."""
    kind = cfg.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_require_file(cfg.vocab_file, "--vocab-file", kind),
                                _require_file(cfg.merge_file, "--merge-file", kind))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        cls = SentencePieceTokenizer if kind == "SentencePieceTokenizer" else GPTSentencePieceTokenizer
        return cls(_require_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "HFTokenizer":
        return HFTokenizer(_require_file(cfg.tokenizer_model, "--tokenizer-model", kind, allow_dir=True))
    if kind == "NullTokenizer":
        if cfg.vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(cfg.vocab_size)
    if kind is None:
        raise ValueError(f"no tokenizer: pass --tokenizer-type (one of {', '.join(TOKENIZER_TYPES)})")
    raise ValueError(f"unknown --tokenizer-type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
