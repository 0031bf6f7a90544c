"""Which tokenizer to build (``TokenizerConfig``) and ``build_tokenizer``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import GPTSentencePieceTokenizer, SentencePieceTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "HFTokenizer", "NullTokenizer")


@dataclass(frozen=True)
class TokenizerConfig:
    tokenizer_type: str | None = None  # one of TOKENIZER_TYPES; the fields below name the files it needs
    vocab_file: str | None = None  # GPT2BPETokenizer: vocab.json
    merge_file: str | None = None  # GPT2BPETokenizer: merges.txt
    tokenizer_model: str | None = None  # SentencePiece(GPT)Tokenizer: the .model file; HFTokenizer: tokenizer.json
    vocab_size: int | None = None  # NullTokenizer: number of text ids (eod is the next id)


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
