"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (our implementation, HF-identical ids)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.byte_level import Gpt2PreTokenizer, bytes_to_unicode

EOD_TOKEN = "<|endoftext|>"


def load_merges(path: str | Path) -> list[tuple[str, str]]:
    """Merge rules in priority order; skips the ``#version`` header and blank lines."""
    merges = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or line.startswith("#version"):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: a merge rule is two symbols separated by one space, "
                                 f"got {line!r}")
            merges.append((parts[0], parts[1]))
    return merges


class GPT2BPETokenizer(MegatronTokenizer):
    """Byte-level BPE: GPT-2 regex pre-tokenisation, bytes mapped to printable characters, then merges.

    Merges apply lowest rank first; equal pairs merge left to right (as GPT-2 and HF do). Pre-token
    results are cached (bounded, per instance). Characters missing from the vocabulary are dropped,
    as HF's BPE does when it has no unknown token.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | Path, merge_file: str | Path, cache_size: int = 100_000):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {i: s for s, i in self.encoder.items()}
        merges = load_merges(merge_file)
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        for a, b in merges:
            if a + b not in self.encoder:
                raise ValueError(f"{merge_file}: merge '{a} {b}' makes {a + b!r}, which is not in {vocab_file}")
        byte_encoder = bytes_to_unicode()
        # latin-1 decoding turns bytes into code points 0..255; translate maps those to GPT-2's characters
        self._byte_table = str.maketrans({chr(b): c for b, c in byte_encoder.items()})
        self._byte_decoder = {c: b for b, c in byte_encoder.items()}
        self._pretokenizer = Gpt2PreTokenizer()
        self._cache: dict[str, list[int]] = {}
        self._cache_size = cache_size
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"{vocab_file} has no {EOD_TOKEN!r} token, which GPT2BPETokenizer uses as "
                             f"end of document; train the vocabulary with it (tools/train_tokenizer.py does)")
        self._eod = self.encoder[EOD_TOKEN]
        self._vocab_size = max(self.encoder.values()) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def _bpe(self, symbols: list[str]) -> list[str]:
        ranks = self.bpe_ranks
        while len(symbols) > 1:
            best, best_rank = None, None
            for pair in zip(symbols, symbols[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            first, second = best
            merged, i, n = [], 0, len(symbols)
            while i < n:
                if i < n - 1 and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            mapped = piece.encode("utf-8").decode("latin-1").translate(self._byte_table)
            symbols = [c for c in mapped if c in self.encoder]
            ids = [self.encoder[s] for s in self._bpe(symbols)]
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pretokenizer.split(text):
            ids.extend(self._encode_piece(piece))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self._byte_decoder[c] for c in text).decode("utf-8", errors="replace")
