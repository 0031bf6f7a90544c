"""What ``--input`` names: files, globs and folders of shards in any supported format, in one document order.

| format | recognised by | read by |
|---|---|---|
| JSONL (plain, ``.gz``, ``.zst``) | any other name; ``.gz``; ``.zst`` / ``.zstd`` | jsonl_reader.py |
| Parquet | ``.parquet`` | columnar_reader.py (pyarrow) |
| Arrow IPC (stream or file) | ``.arrow`` | columnar_reader.py (pyarrow) |
| a folder written by datasets' ``save_to_disk`` | a folder with ``state.json`` | its ``.arrow`` shards, in order |
| any other folder | a folder | its shards (names in ``SHARD_SUFFIXES``), sorted, sub-folders included |

Names given directly or matched by a glob are taken whatever they end in; inside a folder only shard
names count, so a README or a ``.json`` config there is not read as data. Every Parquet and Arrow file's
metadata is checked while planning, before anything is written.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Iterator

from megatron.data.preprocess import columnar_reader, jsonl_reader, saved_dataset
from megatron.data.preprocess.balance import split_evenly
from megatron.data.preprocess.columnar_reader import ColumnarSegment, RecordChunk
from megatron.data.preprocess.jsonl_reader import GZIP_SUFFIXES, ZSTD_SUFFIXES, RawChunk, Segment, zstandard_module

SHARD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd", ".parquet", ".arrow")
COLUMNAR = ("parquet", "arrow")


@dataclass(frozen=True)
class InputFile:
    path: str
    format: str  # "jsonl", "jsonl.gz", "jsonl.zst", "parquet" or "arrow"


def format_of(path: str) -> str:
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".arrow"):
        return "arrow"
    if path.endswith(GZIP_SUFFIXES):
        return "jsonl.gz"
    return "jsonl.zst" if path.endswith(ZSTD_SUFFIXES) else "jsonl"


def _files_under(path: str) -> list[str]:
    """``path`` itself when a file; the shards of a folder (a saved dataset's in its order, others sorted)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        return []
    if saved_dataset.is_saved_dataset_dict(path):
        raise saved_dataset.dataset_dict_error(path)
    if saved_dataset.is_saved_dataset(path):
        return saved_dataset.saved_dataset_shards(path)
    found = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.startswith("."):  # .git, .cache and other tools' files
            continue
        if entry.is_dir():
            found += _files_under(entry.path)
        elif entry.name.endswith(SHARD_SUFFIXES):
            found.append(entry.path)
    return found


def expand_inputs(patterns: list[str]) -> list[InputFile]:
    """The files of ``--input`` in order (each glob sorted); a pattern that yields none is an error."""
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        found = [f for m in matched for f in _files_under(m)]
        if not found:
            if os.path.isdir(pattern):
                raise FileNotFoundError(f"--input {pattern}: the folder holds no input files (names ending in "
                                        f"{', '.join(SHARD_SUFFIXES)}); name other files directly or with a glob")
            raise FileNotFoundError(f"--input {pattern}: no such file" + (" (the glob matched nothing)"
                                                                         if glob.has_magic(pattern) else ""))
        for f in found:
            if f not in seen:
                seen.add(f)
                files.append(f)
    inputs = [InputFile(f, format_of(f)) for f in files]
    zst = next((f.path for f in inputs if f.format == "jsonl.zst"), None)
    if zst is not None:
        zstandard_module(zst)  # a missing package is refused before anything is written
    return inputs


def plan_partitions(files: list[InputFile], keys: tuple[str, ...],
                    partitions: int) -> list[list[Segment | ColumnarSegment]]:
    """Cut the input into ``partitions`` contiguous parts of about equal bytes (balance.py): a plain JSONL
    file anywhere, a compressed one whole, Parquet at row groups and Arrow at record batches."""
    units: list[tuple[int, int]] = []  # (file, unit): a whole file, or a row group / record batch of one
    sizes, divisible = [], []
    described: dict[int, columnar_reader.ColumnarFile] = {}
    for i, f in enumerate(files):
        if f.format in COLUMNAR:
            described[i] = columnar_reader.describe(f.path, f.format, keys)
            units += [(i, u) for u in range(len(described[i].unit_bytes))]
            sizes += described[i].unit_bytes
            divisible += [False] * len(described[i].unit_bytes)
        else:
            units.append((i, 0))
            sizes.append(os.path.getsize(f.path))
            divisible.append(f.format == "jsonl")
    parts: list[list[Segment | ColumnarSegment]] = []
    for part in split_evenly(sizes, divisible, partitions):
        segments: list[Segment | ColumnarSegment] = []
        run = None  # (file, first unit, end unit): consecutive Parquet / Arrow units become one segment
        for item, start, end in part:
            i, unit = units[item]
            if run and run[0] == i and run[2] == unit:
                run = (i, run[1], unit + 1)
                continue
            if run:
                segments.append(described[run[0]].segment(run[1], run[2]))
                run = None
            if i in described:
                run = (i, unit, unit + 1)
            else:
                segments.append(Segment(files[i].path, start, end))
        if run:
            segments.append(described[run[0]].segment(run[1], run[2]))
        parts.append(segments)
    return parts


def read_chunks(segments: list[Segment | ColumnarSegment], keys: tuple[str, ...],
                chunk_bytes: int) -> Iterator[RawChunk | RecordChunk]:
    """The segments' documents in order: raw JSONL lines, or rows of the ``keys`` columns."""
    for segment in segments:
        if isinstance(segment, ColumnarSegment):
            yield from columnar_reader.read_record_chunks(segment, keys, chunk_bytes)
        else:
            yield from jsonl_reader.read_chunks([segment], chunk_bytes)
