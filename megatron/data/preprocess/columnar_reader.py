"""Parquet and Arrow input (Arrow: the shards of a saved Hugging Face dataset, or any Arrow IPC file).

A file is a sequence of units: Parquet row groups, or Arrow record batches. A segment is a run of whole
units (they cannot be entered in the middle); it is read in record batches of about ``chunk_bytes`` of
the ``--json-keys`` columns, which go to the workers as Python lists, one value per row. Rows are
counted from 0 in each file, as pyarrow, pandas and ``datasets`` count them.

``describe`` checks a file before anything is written: readable, every key a text column (a string, or a
list of strings taken as sentences, as in JSONL). pyarrow is imported only here, and only for such input.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

from megatron.data.preprocess.optional_package import optional_package

FIX = "re-download or re-create the file"


def pyarrow_modules(path: str):
    """(pyarrow, pyarrow.compute, pyarrow.parquet), or one clear error naming ``path`` when not installed."""
    return optional_package(("pyarrow", "pyarrow.compute", "pyarrow.parquet"), path,
                            "reading Parquet or Arrow input needs pyarrow")


@dataclass(frozen=True)
class ColumnarSegment:
    path: str
    kind: str          # "parquet", "arrow-stream" (what datasets writes) or "arrow-file"
    first_unit: int    # row group or record batch index
    end_unit: int      # exclusive
    first_row: int     # the file's row index of the segment's first row
    rows: int
    input_bytes: int   # the segment's share of the file's bytes, for progress


@dataclass(frozen=True)
class RecordChunk:
    path: str
    first_row: int              # the file's row index of the chunk's first row
    columns: dict[str, list]    # json key -> one value per row (str, list of str, or None for a null)
    rows: int
    text_bytes: int             # UTF-8 bytes of those columns, for progress
    input_bytes: int


@dataclass(frozen=True)
class ColumnarFile:
    path: str
    kind: str
    unit_rows: tuple[int, ...]
    unit_bytes: tuple[int, ...]  # the file's size spread over the units by their size (sums to the file size)

    def segment(self, first: int, end: int) -> ColumnarSegment:
        return ColumnarSegment(self.path, self.kind, first, end, sum(self.unit_rows[:first]),
                               sum(self.unit_rows[first:end]), sum(self.unit_bytes[first:end]))


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _spread(total: int, weights: list[int]) -> tuple[int, ...]:
    """Integers proportional to ``weights`` that add up to exactly ``total``."""
    whole = max(sum(weights), 1)
    marks, running = [0], 0
    for w in weights:
        running += w
        marks.append(total * running // whole)
    marks[-1] = total if weights else 0
    return tuple(b - a for a, b in zip(marks, marks[1:]))


def _arrow_kind(path: str) -> str:
    with open(path, "rb") as f:
        return "arrow-file" if f.read(6) == b"ARROW1" else "arrow-stream"


def _arrow_batches(pa, path: str, kind: str, first: int = 0) -> Iterator:
    """The record batches of an Arrow IPC file from index ``first``, memory-mapped (skipping costs no reads
    of the data)."""
    with pa.memory_map(path) as source:
        if kind == "arrow-file":
            reader = pa.ipc.open_file(source)
            yield reader.schema
            for i in range(first, reader.num_record_batches):
                yield reader.get_batch(i)
            return
        reader = pa.ipc.open_stream(source)
        yield reader.schema
        for i, batch in enumerate(reader):
            if i >= first:
                yield batch


def _is_text(pa, t) -> bool:
    strings = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    if any(check(t) for check in strings):
        return True
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and any(check(t.value_type) for check in strings)


def _check_columns(pa, path: str, schema, keys: tuple[str, ...]) -> None:
    names = schema.names
    for key in keys:
        if key not in names:
            raise ValueError(f"{path}: column {key!r} missing (columns: {', '.join(map(repr, names)) or 'none'}); "
                             f"choose columns with --json-keys")
        kind = schema.field(key).type
        if not _is_text(pa, kind):
            raise ValueError(f"{path}: column {key!r} holds {kind}, not text (a string or list-of-strings column); "
                             f"choose text columns with --json-keys")


def describe(path: str, fmt: str, keys: tuple[str, ...]) -> ColumnarFile:
    """Units, rows and a schema check of a ``"parquet"`` or ``"arrow"`` file; reads only its metadata."""
    pa, _, pq = pyarrow_modules(path)
    size = os.path.getsize(path)
    try:
        if fmt == "parquet":
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
            groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
            rows = [g.num_rows for g in groups]
            weights = [sum(g.column(j).total_compressed_size for j in range(g.num_columns)) for g in groups]
            kind = "parquet"
        else:
            kind = _arrow_kind(path)
            batches = _arrow_batches(pa, path, kind)
            schema = next(batches)
            sizes = [(batch.num_rows, batch.nbytes) for batch in batches]
            rows, weights = [r for r, _ in sizes], [w for _, w in sizes]
    except (pa.ArrowException, OSError) as e:
        what = "Parquet" if fmt == "parquet" else "Arrow"
        raise ValueError(f"{path}: not a readable {what} file ({_one_line(e)}); {FIX}") from None
    _check_columns(pa, path, schema, keys)
    return ColumnarFile(path, kind, tuple(rows), _spread(size, weights))


def _batches(pa, pq, segment: ColumnarSegment, keys: list[str], chunk_bytes: int) -> Iterator:
    if segment.kind == "parquet":
        with pq.ParquetFile(segment.path, page_checksum_verification=True) as parquet:
            groups = range(segment.first_unit, segment.end_unit)
            meta = parquet.metadata
            text = sum(meta.row_group(i).column(j).total_uncompressed_size for i in groups
                       for j in range(meta.num_columns) if meta.schema.column(j).path.split(".")[0] in keys)
            rows_per_batch = max(1, segment.rows * chunk_bytes // max(text, 1))  # batches of about chunk_bytes
            for group in groups:  # one group at a time: a damaged one is named by its first row
                yield from parquet.iter_batches(rows_per_batch, row_groups=[group], columns=keys, use_threads=False)
        return
    batches = _arrow_batches(pa, segment.path, segment.kind, segment.first_unit)
    next(batches)  # the schema
    for _, batch in zip(range(segment.first_unit, segment.end_unit), batches):
        yield batch.select(keys)


def _text_bytes(pa, pc, column) -> int:
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        column = pc.list_flatten(column)
    if pa.types.is_string_view(column.type):  # (Polars' default) has no length kernel
        column = column.cast(pa.large_string())
    return pc.sum(pc.binary_length(column)).as_py() or 0


def read_record_chunks(segment: ColumnarSegment, keys: tuple[str, ...], chunk_bytes: int) -> Iterator[RecordChunk]:
    """The rows of ``segment`` in chunks; a unit that cannot be read is one error naming the file and row."""
    pa, pc, pq = pyarrow_modules(segment.path)
    keys = list(dict.fromkeys(keys))
    batches = _batches(pa, pq, segment, keys, chunk_bytes)
    row, done = segment.first_row, 0
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return
            batch.validate(full=True)  # bad offsets or UTF-8 from a damaged file: an error, never a crash
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{segment.path}: corrupt data at row {row} or after ({_one_line(e)}); {FIX}") from None
        step = max(1, batch.num_rows * chunk_bytes // max(batch.nbytes, 1))
        for start in range(0, batch.num_rows, step):
            piece = batch.slice(start, step)
            done += piece.num_rows
            input_bytes = segment.input_bytes * done // max(segment.rows, 1) - \
                segment.input_bytes * (done - piece.num_rows) // max(segment.rows, 1)
            yield RecordChunk(segment.path, row, {k: piece.column(k).to_pylist() for k in keys}, piece.num_rows,
                              sum(_text_bytes(pa, pc, piece.column(k)) for k in keys), input_bytes)
            row += piece.num_rows
