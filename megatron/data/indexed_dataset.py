"""Megatron's memory-mapped indexed dataset: ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (index).

``.idx`` layout (little-endian, no padding; byte-compatible with Megatron-LM):
    9 bytes magic ``MMIDIDX\\x00\\x00`` | uint64 version = 1 | uint8 dtype code | uint64 N sequences |
    uint64 D = len(document index) | int32[N] sequence lengths | int64[N] byte offsets into .bin |
    int64[D] document index (sequence boundaries, starting at 0, ending at N)
The builder streams: tokens go straight to ``.bin`` and lengths / document boundaries to side files, so its
memory does not grow with the dataset; ``finalize`` assembles the ``.idx`` from them in chunks.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_CHUNK = 1 << 22  # elements per chunk when streaming index arrays


def best_fitting_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's rule: uint16 when every id fits comfortably, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def data_file_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


def dataset_exists(prefix: str | Path) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def _read_header(path: str) -> tuple[np.dtype, int, int]:
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE or header[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path} is not a Megatron mmap index (bad magic); was it written by "
                         f"tools/preprocess_data.py or Megatron-LM's preprocess_data.py?")
    version, code, n, d = struct.unpack("<QBQQ", header[len(MAGIC):])
    if version != VERSION:
        raise ValueError(f"{path}: index version {version}, only version {VERSION} is supported")
    if code not in DTYPE_CODES:
        raise ValueError(f"{path}: unknown dtype code {code}")
    return np.dtype(DTYPE_CODES[code]), n, d


class MMapIndexedDataset:
    """Random access to sequences of a ``.bin/.idx`` pair through memory maps (nothing is read up front).

    ``ds[i]`` is sequence i, ``ds[a:b]`` a list of sequences, ``ds.get(i, offset, length)`` part of one.
    ``sizes`` are sequence lengths, ``pointers`` byte offsets and ``doc_idx`` the document boundaries.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found (a dataset prefix needs both {prefix}.bin and "
                                        f"{prefix}.idx)")
        self.dtype, n, d = _read_header(idx_path)
        expected = HEADER_SIZE + 4 * n + 8 * n + 8 * d
        if os.path.getsize(idx_path) != expected:
            raise ValueError(f"{idx_path}: {os.path.getsize(idx_path)} bytes, the header promises {expected} "
                             f"({n} sequences, {d} document-index entries); the file is truncated or corrupt")
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.pointers = np.frombuffer(index, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        self.doc_idx = np.frombuffer(index, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
        bin_bytes = os.path.getsize(bin_path)
        expected_bin = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
        if bin_bytes != expected_bin:
            raise ValueError(f"{bin_path}: {bin_bytes} bytes, {idx_path} describes {expected_bin}; "
                             f"the pair does not belong together or one is truncated")
        # mmap cannot map an empty file
        self._bin = (np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_bytes
                     else np.empty(0, dtype=self.dtype))

    def __reduce__(self):
        # pickled (e.g. into spawned data-loader workers) as its prefix, never as the mapped data
        return type(self), (self.prefix,)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (to its end when length is None)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {idx} "
                             f"of length {size}")
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an indexed dataset must be contiguous (step 1)")
            if stop <= start:
                return []
            first = int(self.pointers[start]) // self.dtype.itemsize
            ends = np.cumsum(self.sizes[start:stop], dtype=np.int64)
            return np.split(self._bin[first:first + int(ends[-1])], ends[:-1])
        return self.get(int(idx))


class MMapIndexedDatasetBuilder:
    """Writes a ``.bin/.idx`` pair document by document with constant memory.

    Tokens stream to ``bin_path``; sequence lengths and document boundaries stream to two side files next
    to it and become the ``.idx`` at ``finalize``. Callers pick the final names, so they can write to
    temporary names and rename when everything is complete.
    """

    def __init__(self, bin_path: str | Path, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self.bin_path = str(bin_path)
        self._bin = open(self.bin_path, "wb")
        self._lengths = open(self.bin_path + ".lengths", "wb")
        self._docs = open(self.bin_path + ".docs", "wb")
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
                      sequences_per_document: np.ndarray) -> None:
        """Append whole documents: ``tokens`` concatenated, split into sequences, grouped into documents."""
        sequence_lengths = np.asarray(sequence_lengths, dtype="<i4")
        sequences_per_document = np.asarray(sequences_per_document, dtype=np.int64)
        if int(sequence_lengths.sum()) != len(tokens) or int(sequences_per_document.sum()) != len(sequence_lengths):
            raise ValueError("sequence lengths must add up to the tokens and documents to the sequences")
        self._bin.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.write(sequence_lengths.tobytes())
        boundaries = self.num_sequences + np.cumsum(sequences_per_document, dtype="<i8")
        self._docs.write(boundaries.astype("<i8").tobytes())
        self.num_sequences += len(sequence_lengths)
        self.num_documents += len(sequences_per_document)
        self.num_tokens += len(tokens)

    def add_document(self, tokens: Sequence[int], sequence_lengths: Sequence[int]) -> None:
        """Megatron's ``add_document``: one document made of ``len(sequence_lengths)`` sequences."""
        self.add_documents(np.asarray(tokens), np.asarray(sequence_lengths), np.array([len(sequence_lengths)]))

    def add_index(self, prefix: str | Path) -> None:
        """Append every document of an existing dataset (same dtype), copying its ``.bin`` as bytes."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix} holds {other.dtype} tokens, the merged dataset {self.dtype}; "
                             f"merge only datasets made with the same tokenizer")
        with open(data_file_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 24)
        for start in range(0, len(other), _CHUNK):
            self._lengths.write(np.asarray(other.sizes[start:start + _CHUNK], dtype="<i4").tobytes())
        for start in range(1, len(other.doc_idx), _CHUNK):
            boundaries = np.asarray(other.doc_idx[start:start + _CHUNK], dtype="<i8") + self.num_sequences
            self._docs.write(boundaries.tobytes())
        self.num_sequences += len(other)
        self.num_documents += other.num_documents
        self.num_tokens += int(other.sizes.sum(dtype=np.int64))

    def finalize(self, idx_path: str | Path) -> None:
        """Write ``idx_path`` and remove the side files."""
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        n, d = self.num_sequences, self.num_documents + 1
        lengths = np.memmap(self._lengths.name, mode="r", dtype="<i4") if n else np.empty(0, "<i4")
        with open(idx_path, "wb") as out:
            out.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype], n, d))
            for start in range(0, n, _CHUNK):
                out.write(np.asarray(lengths[start:start + _CHUNK]).tobytes())
            offset = 0  # pointers: exclusive prefix sum of byte lengths, carried across chunks
            for start in range(0, n, _CHUNK):
                nbytes = np.asarray(lengths[start:start + _CHUNK], dtype=np.int64) * self.dtype.itemsize
                ends = np.cumsum(nbytes) + offset
                out.write((ends - nbytes).astype("<i8").tobytes())
                offset = int(ends[-1])
            out.write(np.zeros(1, dtype="<i8").tobytes())
            with open(self._docs.name, "rb") as docs:
                shutil.copyfileobj(docs, out, 1 << 24)
        del lengths
        os.remove(self._lengths.name)
        os.remove(self._docs.name)

    def discard(self) -> None:
        """Close and delete everything written so far (on failure)."""
        for f in (self._bin, self._lengths, self._docs):
            f.close()
            if os.path.exists(f.name):
                os.remove(f.name)


def install_dataset(tmp_prefix: str | Path, final_prefix: str | Path) -> None:
    """Rename a complete ``.bin/.idx`` pair to its final names; the ``.idx`` goes last, so a reader never
    pairs a new ``.bin`` with an old ``.idx`` (and sizes are checked on open anyway)."""
    if os.path.exists(index_file_path(final_prefix)):
        os.remove(index_file_path(final_prefix))
    os.replace(data_file_path(tmp_prefix), data_file_path(final_prefix))
    os.replace(index_file_path(tmp_prefix), index_file_path(final_prefix))


def merge_datasets(prefixes: Sequence[str | Path], output_prefix: str | Path) -> MMapIndexedDataset:
    """Concatenate datasets (same dtype) in order into ``output_prefix``, written under temporary names."""
    if not prefixes:
        raise ValueError("nothing to merge")
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise ValueError(f"the merge output {output_prefix} is also one of its inputs")
    tmp = f"{output_prefix}.tmp-{os.getpid()}"
    builder = MMapIndexedDatasetBuilder(data_file_path(tmp), MMapIndexedDataset(prefixes[0]).dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(tmp))
    except BaseException:
        builder.discard()
        if os.path.exists(index_file_path(tmp)):
            os.remove(index_file_path(tmp))
        raise
    install_dataset(tmp, output_prefix)
    return MMapIndexedDataset(output_prefix)
