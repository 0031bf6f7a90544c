"""Worker side of preprocessing: raw JSONL chunk -> token arrays per JSON key, with per-line errors.

Each line is one document. For each ``--json-keys`` key the value (a string, or a list of strings taken
as its sentences) is optionally sentence-split and tokenized; empty sentences are dropped, and with
``--append-eod`` a non-empty document ends with eod (Megatron's rules). A document with no tokens is
kept as a document of zero sequences. A line that is not a JSON object with every key as text is a
bad line: reported with its position, and no key gets a document from it.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np

from megatron.data.indexed_dataset import best_fitting_dtype
from megatron.data.preprocess.jsonl_reader import RawChunk
from megatron.tokenizer import TokenizerConfig, build_tokenizer


@dataclass(frozen=True)
class EncoderSettings:
    tokenizer: TokenizerConfig
    json_keys: tuple[str, ...]
    append_eod: bool
    punkt_params: bytes | None  # set when splitting sentences
    keep_newlines: bool


@dataclass
class KeyOutput:
    tokens: np.ndarray                 # all tokens of the chunk's documents, concatenated
    sequence_lengths: np.ndarray       # int32, one per sequence
    sequences_per_document: np.ndarray  # int64, one per document


@dataclass
class EncodedChunk:
    path: str
    segment_start: int
    first_line: int
    input_bytes: int
    text_bytes: int
    documents: int
    blank_lines: int
    outputs: dict[str, KeyOutput]
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line index in segment, problem)


class DocumentEncoder:
    def __init__(self, settings: EncoderSettings):
        self.settings = settings
        self.tokenizer = build_tokenizer(settings.tokenizer)
        self.dtype = best_fitting_dtype(self.tokenizer.vocab_size)
        self.splitter = None
        if settings.punkt_params is not None:
            # nltk is optional: only --split-sentences needs it, and the job checked it is installed.
            from megatron.data.preprocess.sentence_splitter import SentenceSplitter
            self.splitter = SentenceSplitter(settings.punkt_params, settings.keep_newlines)

    def _texts(self, record, key: str) -> list[str]:
        if key not in record:
            raise ValueError(f"key {key!r} missing (keys present: {', '.join(map(repr, record)) or 'none'}); "
                             f"choose keys with --json-keys")
        value = record[key]
        if isinstance(value, str):
            return self.splitter.split(value) if self.splitter else [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ValueError(f"key {key!r} holds {type(value).__name__}, expected a string or a list of strings")

    def _document(self, record) -> dict[str, list[list[int]]]:
        document = {}
        for key in self.settings.json_keys:
            texts = self._texts(record, key)
            try:
                sentences = [ids for ids in map(self.tokenizer.tokenize, texts) if ids]
            except (ValueError, TypeError) as e:  # e.g. lone surrogates, or non-ids for NullTokenizer
                raise ValueError(f"cannot tokenize {key!r}: {e}") from None
            if sentences and self.settings.append_eod:
                sentences[-1] = sentences[-1] + [self.tokenizer.eod]
            document[key] = sentences
        return document

    def encode(self, chunk: RawChunk) -> EncodedChunk:
        lines = chunk.data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        tokens = {k: [] for k in self.settings.json_keys}
        lengths = {k: [] for k in self.settings.json_keys}
        per_doc = {k: [] for k in self.settings.json_keys}
        bad, blank, documents, text_bytes = [], 0, 0, 0
        for i, line in enumerate(lines):
            if not line.strip():
                blank += 1
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # includes UnicodeDecodeError
                bad.append((chunk.first_line + i, f"invalid JSON ({e})"))
                continue
            try:
                if not isinstance(record, dict):
                    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                document = self._document(record)
            except ValueError as e:
                bad.append((chunk.first_line + i, str(e)))
                continue
            documents += 1
            text_bytes += len(line)
            for key, sentences in document.items():
                for ids in sentences:
                    tokens[key].extend(ids)
                    lengths[key].append(len(ids))
                per_doc[key].append(len(sentences))
        outputs = {k: KeyOutput(np.array(tokens[k], dtype=self.dtype), np.array(lengths[k], dtype=np.int32),
                                np.array(per_doc[k], dtype=np.int64)) for k in self.settings.json_keys}
        return EncodedChunk(chunk.path, chunk.segment_start, chunk.first_line, chunk.input_bytes, text_bytes,
                            documents, blank, outputs, bad)


@functools.lru_cache(maxsize=1)
def _encoder(settings: EncoderSettings) -> DocumentEncoder:
    return DocumentEncoder(settings)  # built once per worker process, reused for every chunk


def encode_chunk(settings: EncoderSettings, chunk: RawChunk) -> EncodedChunk:
    """Pool task: encode one chunk with this process's encoder for ``settings``."""
    return _encoder(settings).encode(chunk)
