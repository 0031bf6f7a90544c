"""Streaming JSONL input: globs, ``.gz``, byte-range partitions, raw line chunks with their line numbers.

A partition is a list of segments (a byte range of a plain file, or a whole ``.gz`` file). A line belongs
to the segment its first byte falls in, so adjacent ranges split a file without losing or repeating a
line. Chunks carry raw bytes (parsing happens in the worker processes); reading never holds more than
one chunk per call, whatever the input size.
"""
from __future__ import annotations

import glob
import gzip
import os
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Segment:
    path: str
    start: int  # byte offset (always 0 for .gz)
    end: int    # exclusive byte offset (the compressed size for .gz)

    @property
    def compressed(self) -> bool:
        return self.path.endswith(".gz")


@dataclass(frozen=True)
class RawChunk:
    path: str
    segment_start: int
    first_line: int       # index of the chunk's first line within its segment (0-based)
    data: bytes           # whole lines, newline-terminated except possibly a file's last line
    input_bytes: int      # bytes of the input file consumed (compressed bytes for .gz), for progress


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by ``--input`` (paths or globs), sorted within each pattern; an unmatched one is an error."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matched = [m for m in matched if os.path.isfile(m)]
        if not matched:
            raise FileNotFoundError(f"--input {pattern}: no such file" + (" (the glob matched nothing)"
                                                                         if glob.has_magic(pattern) else ""))
        files.extend(m for m in matched if m not in files)
    return files


def plan_partitions(files: list[str], partitions: int) -> list[list[Segment]]:
    """Cut the inputs into ``partitions`` contiguous parts of about equal size, in input order.

    Plain files are cut at byte offsets (aligned to lines when read); a ``.gz`` file cannot be entered
    mid-stream, so it goes whole to the part where most of it falls (some parts may then be empty).
    """
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    cuts = [total * k // partitions for k in range(1, partitions)]
    parts: list[list[Segment]] = [[] for _ in range(partitions)]
    offset = 0
    for path, size in zip(files, sizes):
        if path.endswith(".gz"):
            middle = offset + size // 2
            parts[sum(c <= middle for c in cuts)].append(Segment(path, 0, size))
        else:
            start = offset
            for part, cut in enumerate(cuts + [total + 1]):
                stop = min(cut, offset + size)
                if stop > start:
                    parts[part].append(Segment(path, start - offset, stop - offset))
                    start = stop
        offset += size
    return parts


def _plain_chunks(segment: Segment, chunk_bytes: int) -> Iterator[RawChunk]:
    with open(segment.path, "rb") as f:
        if segment.start > 0:
            f.seek(segment.start - 1)
            f.readline()  # the line under way at `start` belongs to the previous segment
        pos, line = f.tell(), 0
        while pos < segment.end:
            data = f.read(chunk_bytes)
            if not data:
                break
            if not data.endswith(b"\n"):
                data += f.readline()
            if pos + len(data) > segment.end:  # keep only lines that start before the end
                cut = data.find(b"\n", segment.end - pos - 1)
                data = data if cut < 0 else data[:cut + 1]
            yield RawChunk(segment.path, segment.start, line, data, len(data))
            line += data.count(b"\n") + (not data.endswith(b"\n"))
            pos += len(data)


def _gzip_chunks(segment: Segment, chunk_bytes: int) -> Iterator[RawChunk]:
    with open(segment.path, "rb") as raw, gzip.GzipFile(fileobj=raw) as f:
        line, consumed = 0, 0
        while True:
            try:
                data = f.read(chunk_bytes)
                if data and not data.endswith(b"\n"):
                    data += f.readline()
            except (OSError, EOFError) as e:
                raise ValueError(f"{segment.path}: corrupt gzip stream after line {line}: {e}") from None
            if not data:
                break
            yield RawChunk(segment.path, 0, line, data, raw.tell() - consumed)
            consumed = raw.tell()
            line += data.count(b"\n") + (not data.endswith(b"\n"))


def read_chunks(segments: list[Segment], chunk_bytes: int = 1 << 20) -> Iterator[RawChunk]:
    for segment in segments:
        yield from (_gzip_chunks if segment.compressed else _plain_chunks)(segment, chunk_bytes)


def line_number(path: str, segment_start: int, line_in_segment: int) -> int:
    """1-based line number in the file of line ``line_in_segment`` of the segment starting at ``segment_start``."""
    if segment_start == 0:
        return line_in_segment + 1
    newlines = 0
    with open(path, "rb") as f:
        f.seek(segment_start - 1)
        f.readline()
        segment_first_byte = f.tell()
        f.seek(0)
        remaining = segment_first_byte
        while remaining > 0:
            block = f.read(min(remaining, 1 << 24))
            newlines += block.count(b"\n")
            remaining -= len(block)
    return newlines + line_in_segment + 1
