"""SentencePiece tokenizers with Megatron's two conventions (``--tokenizer-model file.model``).

``SentencePieceTokenizer`` adds Megatron's special tokens (<CLS> <SEP> <EOD> <MASK> and the model's
pad/bos/eos pieces) after the model's own pieces when the model lacks them, and keeps them whole when
they occur in text; ``eod`` is <EOD>. ``GPTSentencePieceTokenizer`` is the plain model with eod = eos.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import sentencepiece

from megatron.tokenizer.base import MegatronTokenizer


def _load(model_file: str | Path) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(model_file))


class SentencePieceTokenizer(MegatronTokenizer):
    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str | Path):
        self.sp = _load(model_file)
        self.vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.special_tokens: dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(token)
        for piece_id, fallback in ((self.sp.pad_id(), "<PAD>"), (self.sp.bos_id(), "<BOS>"),
                                   (self.sp.eos_id(), "<EOS>")):
            self._add_special(self.sp.id_to_piece(piece_id) if 0 <= piece_id < self.sp.get_piece_size()
                              else fallback)
        self.inv_special_tokens = {i: t for t, i in self.special_tokens.items()}
        self._eod = self.vocab["<EOD>"]

    def _add_special(self, token: str) -> None:
        if token not in self.vocab:
            self.vocab[token] = len(self.vocab)
        self.special_tokens[token] = self.vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:
            found = [(pos, token) for token in self.special_tokens
                     if (pos := text.find(token, start)) != -1]
            if not found:
                break
            pos, token = min(found, key=lambda hit: hit[0])  # ties: first in insertion order
            ids.extend(self.sp.encode_as_ids(text[start:pos]))
            ids.append(self.special_tokens[token])
            start = pos + len(token)
        ids.extend(self.sp.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self.inv_special_tokens:
                text += self.sp.decode_ids(ids[last:i]) + " " + self.inv_special_tokens[token_id] + " "
                last = i + 1
        return text + self.sp.decode_ids(ids[last:])


class GPTSentencePieceTokenizer(MegatronTokenizer):
    name = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str | Path):
        self.sp = _load(model_file)
        if self.sp.eos_id() < 0:
            raise ValueError(f"{model_file} has no eos piece, which GPTSentencePieceTokenizer uses as end of "
                             f"document; train it with an eos id (tools/train_tokenizer.py does)")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self.sp.eos_id()

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.sp.decode_ids([int(i) for i in ids])
