"""Worker side of preprocessing: a chunk (raw JSONL lines, or Parquet/Arrow rows) -> token arrays per key.

Each line or row is one document. For each ``--json-keys`` key the value (a string, or a list of strings
taken as its sentences) is optionally sentence-split and tokenized; empty sentences are dropped, and with
``--append-eod`` a non-empty document ends with eod (Megatron's rules). A document with no tokens is
kept as a document of zero sequences. A line that is not a JSON object with every key as text (or a row
with a null) is bad: reported with its position, and no key gets a document from it. The same documents
give the same tokens whatever format they came in.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from megatron.data.indexed_dataset import best_fitting_dtype
from megatron.data.preprocess.columnar_reader import RecordChunk
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
    rows: bool          # positions are rows of a Parquet/Arrow file, else lines of a JSONL segment
    segment_start: int  # the JSONL segment's byte offset (0 for rows)
    first: int          # index of the chunk's first line in its segment, or of its first row in the file
    input_bytes: int
    text_bytes: int
    documents: int
    blank_lines: int
    outputs: dict[str, KeyOutput]
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (index in the chunk, problem)


def records(chunk: RawChunk | RecordChunk) -> Iterator[tuple[int, dict | None, str | None]]:
    """The chunk's lines or rows as (index in the chunk, record, problem): a document is (i, record, None),
    a blank line (i, None, None), a line that is not a JSON object (i, None, why)."""
    if isinstance(chunk, RecordChunk):
        keys = list(chunk.columns)
        for i, values in enumerate(zip(*chunk.columns.values())):
            yield i, dict(zip(keys, values)), None
        return
    lines = chunk.data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, line in enumerate(lines):
        if not line.strip():
            yield i, None, None
            continue
        try:
            record = json.loads(line)
        except ValueError as e:  # includes UnicodeDecodeError
            yield i, None, f"invalid JSON ({e})"
            continue
        if isinstance(record, dict):
            yield i, record, None
        else:
            yield i, None, f"expected a JSON object, got {type(record).__name__}"


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
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"key {key!r} holds {kind}, expected a string or a list of strings")

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

    def encode(self, chunk: RawChunk | RecordChunk) -> EncodedChunk:
        tokens = {k: [] for k in self.settings.json_keys}
        lengths = {k: [] for k in self.settings.json_keys}
        per_doc = {k: [] for k in self.settings.json_keys}
        bad, blank, documents = [], 0, 0
        for i, record, problem in records(chunk):
            if record is None:
                if problem is None:
                    blank += 1
                else:
                    bad.append((i, problem))
                continue
            try:
                document = self._document(record)
            except ValueError as e:
                bad.append((i, str(e)))
                continue
            documents += 1
            for key, sentences in document.items():
                for ids in sentences:
                    tokens[key].extend(ids)
                    lengths[key].append(len(ids))
                per_doc[key].append(len(sentences))
        outputs = {k: KeyOutput(np.array(tokens[k], dtype=self.dtype), np.array(lengths[k], dtype=np.int32),
                                np.array(per_doc[k], dtype=np.int64)) for k in self.settings.json_keys}
        if isinstance(chunk, RecordChunk):
            return EncodedChunk(chunk.path, True, 0, chunk.first_row, chunk.input_bytes, chunk.text_bytes,
                                documents, blank, outputs, bad)
        return EncodedChunk(chunk.path, False, chunk.segment_start, chunk.first_line, chunk.input_bytes,
                            len(chunk.data), documents, blank, outputs, bad)


@functools.lru_cache(maxsize=1)
def _encoder(settings: EncoderSettings) -> DocumentEncoder:
    return DocumentEncoder(settings)  # built once per worker process, reused for every chunk


def encode_chunk(settings: EncoderSettings, chunk: RawChunk | RecordChunk) -> EncodedChunk:
    """Pool task: encode one chunk with this process's encoder for ``settings``."""
    return _encoder(settings).encode(chunk)
