"""Tokenizer flags -> ``TokenizerConfig`` (no torch: the preprocessing tools import this)."""
from __future__ import annotations

import argparse

from megatron.tokenizer.config import TOKENIZER_TYPES, TokenizerConfig


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


def tokenizer_config_from_args(args: argparse.Namespace) -> TokenizerConfig:
    # --vocab-file with --merge-file is GPT-2's BPE (Megatron's GPT-3 and Megatron-DeepSpeed's GPT scripts leave
    # the type out).
    tokenizer_type = args.tokenizer_type
    if tokenizer_type is None and args.vocab_file and args.merge_file:
        tokenizer_type = "GPT2BPETokenizer"
    return TokenizerConfig(tokenizer_type=tokenizer_type, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                           vocab_size=args.vocab_size)
