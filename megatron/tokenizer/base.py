"""The interface every tokenizer exposes to preprocessing and training."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence


class MegatronTokenizer(ABC):
    """Text <-> token ids, plus the vocabulary size and the end-of-document id.

    ``vocab_size`` is the unpadded size: every id the tokenizer can produce is below it
    (the trainer pads it to a multiple of ``--make-vocab-size-divisible-by``).
    """

    name: str = "tokenizer"

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        ...

    @property
    @abstractmethod
    def eod(self) -> int:
        ...

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"
