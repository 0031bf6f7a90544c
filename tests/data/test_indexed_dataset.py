"""The mmap .bin/.idx format, byte by byte against the spec; round trips; merging."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    merge_datasets,
)
from tools import merge_datasets as merge_tool

# documents as lists of sequences (sentences); the third document is empty
DOCUMENTS = [[[1, 2, 3], [4, 5]], [[6]], [], [[7, 8, 9, 10], [], [11]]]


def write(prefix, documents, dtype) -> None:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in documents:
        builder.add_document([t for seq in doc for t in seq], [len(seq) for seq in doc])
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4)])
def test_idx_bytes_follow_the_spec(tmp_path, dtype, code):
    prefix = tmp_path / "ds"
    write(prefix, DOCUMENTS, dtype)
    raw = (tmp_path / "ds.idx").read_bytes()
    lengths = [len(s) for d in DOCUMENTS for s in d]
    n, d = len(lengths), len(DOCUMENTS) + 1
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == code
    assert struct.unpack("<QQ", raw[18:34]) == (n, d)
    assert list(struct.unpack(f"<{n}i", raw[34:34 + 4 * n])) == lengths
    itemsize = np.dtype(dtype).itemsize
    pointers = list(np.cumsum([0] + lengths[:-1]) * itemsize)
    assert list(struct.unpack(f"<{n}q", raw[34 + 4 * n:34 + 12 * n])) == pointers
    # document index: sequence boundaries; the empty document repeats its boundary
    assert list(struct.unpack(f"<{d}q", raw[34 + 12 * n:])) == [0, 2, 3, 3, 6]
    assert len(raw) == 34 + 12 * n + 8 * d
    tokens = [t for doc in DOCUMENTS for s in doc for t in s]
    assert (tmp_path / "ds.bin").read_bytes() == np.array(tokens, dtype=f"<{np.dtype(dtype).char}").tobytes()


def test_round_trip_and_random_access(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 60000, size=rng.integers(0, 50)).tolist() for _ in range(rng.integers(0, 4))]
            for _ in range(300)]
    write(tmp_path / "rt", docs, np.uint16)
    ds = MMapIndexedDataset(tmp_path / "rt")
    sequences = [s for d in docs for s in d]
    assert len(ds) == len(sequences) and ds.num_documents == len(docs) and ds.dtype == np.uint16
    assert isinstance(ds._bin, np.memmap)  # reads go through the memory map
    for i in rng.integers(0, len(sequences), size=50):
        assert ds[int(i)].tolist() == sequences[i]
        if len(sequences[i]) > 2:
            assert ds.get(int(i), offset=1, length=len(sequences[i]) - 2).tolist() == sequences[i][1:-1]
    assert [s.tolist() for s in ds[10:40]] == sequences[10:40]
    boundaries = np.cumsum([0] + [len(d) for d in docs])
    assert ds.doc_idx.tolist() == boundaries.tolist()
    with pytest.raises(IndexError):
        ds.get(0, offset=0, length=ds.sizes[0] + 1)


def test_dtype_rule():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(128256) == np.int32


def test_corrupt_files_are_clear_errors(tmp_path):
    write(tmp_path / "c", DOCUMENTS, np.uint16)
    with open(tmp_path / "c.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="c.bin: 24 bytes, .* describes 22"):
        MMapIndexedDataset(tmp_path / "c")
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(raw[:-8])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        MMapIndexedDataset(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(b"NOTANIDX" + raw[8:])
    with pytest.raises(ValueError, match="bad magic"):
        MMapIndexedDataset(tmp_path / "c")
    os.remove(tmp_path / "c.bin")
    with pytest.raises(FileNotFoundError, match="c.bin not found"):
        MMapIndexedDataset(tmp_path / "c")


def test_merge(tmp_path, capsys):
    parts = [DOCUMENTS, [[[20, 21]], []], [[[30]], [[31, 32], [33]]]]
    for i, docs in enumerate(parts):
        write(tmp_path / f"p{i}", docs, np.uint16)
    write(tmp_path / "all", [d for docs in parts for d in docs], np.uint16)
    merge_tool.main(["--input", *(str(tmp_path / f"p{i}") for i in range(3)), "--output-prefix",
                     str(tmp_path / "merged")])
    assert "merged 3 datasets" in capsys.readouterr().out
    for ext in ("bin", "idx"):  # identical to writing everything at once
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"all.{ext}").read_bytes()
    assert not [f for f in os.listdir(tmp_path) if "tmp" in f]
    # a directory input takes its prefixes in name order
    os.makedirs(tmp_path / "dir")
    for i in (1, 0):
        write(tmp_path / "dir" / f"p{i}", parts[i], np.uint16)
    merged = merge_datasets(merge_tool.input_prefixes([str(tmp_path / "dir")]), tmp_path / "dirmerged")
    assert [s.tolist() for s in merged[0:len(merged)]] == [s for docs in parts[:2] for d in docs for s in d]
    write(tmp_path / "wide", DOCUMENTS, np.int32)
    with pytest.raises(ValueError, match="same tokenizer"):
        merge_datasets([tmp_path / "p0", tmp_path / "wide"], tmp_path / "bad")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("bad")]
