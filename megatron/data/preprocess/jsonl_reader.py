"""Streaming JSONL input: globs, ``.gz`` and ``.zst``, byte-range partitions, raw line chunks with their lines.

A partition is a list of segments (a byte range of a plain file, or a whole compressed file). A line
belongs to the segment its first byte falls in, so adjacent ranges split a file without losing or
repeating a line. Chunks carry raw bytes (parsing happens in the worker processes); reading never holds
more than one chunk per call, whatever the input size. The ``zstandard`` package is imported only for
``.zst`` input.
"""
from __future__ import annotations

import glob
import gzip
import os
from dataclasses import dataclass
from typing import Iterator

from megatron.data.preprocess.balance import split_evenly
from megatron.data.preprocess.optional_package import optional_package

GZIP_SUFFIXES = (".gz",)
ZSTD_SUFFIXES = (".zst", ".zstd")
ZSTD_MAX_WINDOW = 1 << 31  # accept files made with `zstd --long=31` (memory is used only if a file needs it)


@dataclass(frozen=True)
class Segment:
    path: str
    start: int  # byte offset (always 0 for a compressed file)
    end: int    # exclusive byte offset (the compressed size for a compressed file)

    @property
    def compressed(self) -> bool:
        return self.path.endswith(GZIP_SUFFIXES + ZSTD_SUFFIXES)


@dataclass(frozen=True)
class RawChunk:
    path: str
    segment_start: int
    first_line: int       # index of the chunk's first line within its segment (0-based)
    data: bytes           # whole lines, newline-terminated except possibly a file's last line
    input_bytes: int      # bytes of the input file consumed (compressed bytes when compressed), for progress


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
    """Cut the inputs into ``partitions`` contiguous parts of about equal size, in input order (balance.py):
    plain files at byte offsets (aligned to lines when read), a compressed file whole."""
    sizes = [os.path.getsize(f) for f in files]
    parts = split_evenly(sizes, [not Segment(f, 0, 0).compressed for f in files], partitions)
    return [[Segment(files[i], start, end) for i, start, end in part] for part in parts]


def zstandard_module(path: str):
    """The ``zstandard`` package, or one clear error naming ``path`` when it is not installed."""
    return optional_package(("zstandard",), path, "reading .zst input needs the zstandard package")[0]


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
                raise ValueError(f"{segment.path}: corrupt gzip stream after line {line}: {e}; re-download or "
                                 f"re-compress the file") from None
            if not data:
                break
            yield RawChunk(segment.path, 0, line, data, raw.tell() - consumed)
            consumed = raw.tell()
            line += data.count(b"\n") + (not data.endswith(b"\n"))


def _zstd_chunks(segment: Segment, chunk_bytes: int) -> Iterator[RawChunk]:
    """A zstd stream of any number of frames, decompressed frame by frame: unlike the library's stream
    reader, this notices a stream cut off in the middle of a frame (a truncated download)."""
    zstandard = zstandard_module(segment.path)
    decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    fix = "re-download or re-compress the file"
    with open(segment.path, "rb") as raw:
        frame, mid_frame = decompressor.decompressobj(), False
        pending, line, consumed = b"", 0, 0
        while True:
            block = raw.read(max(chunk_bytes // 4, 1))  # text compresses about 4x: chunks of about chunk_bytes
            at_end = not block
            try:
                while block:
                    pending += frame.decompress(block)
                    mid_frame = not frame.eof
                    block = frame.unused_data if frame.eof else b""
                    if frame.eof:
                        frame = decompressor.decompressobj()
            except zstandard.ZstdError as e:
                done = line + pending.count(b"\n")
                raise ValueError(f"{segment.path}: corrupt zstd stream after line {done}: {e}; {fix}") from None
            if at_end and mid_frame:
                done = line + pending.count(b"\n")
                raise ValueError(f"{segment.path}: the zstd stream ends in the middle of a frame, after line {done} "
                                 f"(a truncated file?); {fix}")
            cut = len(pending) if at_end else pending.rfind(b"\n") + 1
            if cut and (at_end or len(pending) >= chunk_bytes):
                data, pending = pending[:cut], pending[cut:]
                yield RawChunk(segment.path, 0, line, data, raw.tell() - consumed)
                consumed = raw.tell()
                line += data.count(b"\n") + (not data.endswith(b"\n"))
            if at_end:
                return


def read_chunks(segments: list[Segment], chunk_bytes: int = 1 << 20) -> Iterator[RawChunk]:
    for segment in segments:
        if segment.path.endswith(ZSTD_SUFFIXES):
            yield from _zstd_chunks(segment, chunk_bytes)
        else:
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
