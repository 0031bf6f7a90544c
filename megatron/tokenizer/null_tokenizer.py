"""Megatron's NullTokenizer: text is space-separated integer ids; eod is the id after the vocabulary."""
from __future__ import annotations

from typing import Sequence

from megatron.tokenizer.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """``--vocab-size N`` gives ids 0..N-1 for text plus eod = N, so ``vocab_size`` is N + 1."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size <= 0:
            raise ValueError(f"--vocab-size must be positive for NullTokenizer, got {vocab_size}")
        self._text_vocab = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._text_vocab + 1

    @property
    def eod(self) -> int:
        return self._text_vocab

    def tokenize(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        if ids and (min(ids) < 0 or max(ids) >= self._text_vocab):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ValueError(f"NullTokenizer: id {bad} is outside [0, {self._text_vocab}) (--vocab-size)")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
