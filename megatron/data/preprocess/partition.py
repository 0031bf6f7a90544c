"""One partition of a preprocessing run: read its segments, encode on a worker pool, write in input order.

At most ``2 * workers`` chunks are in flight (read but not yet written), so memory stays flat however
large the input: the reader waits for the oldest chunk to be written before reading more. Runs in its
own process; progress and the outcome go to the parent through ``events``.
"""
from __future__ import annotations

import multiprocessing as mp
import traceback
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.data.preprocess.columnar_reader import ColumnarSegment
from megatron.data.preprocess.document_encoder import EncodedChunk, EncoderSettings, encode_chunk
from megatron.data.preprocess.inputs import read_chunks
from megatron.data.preprocess.jsonl_reader import Segment, line_number

MAX_BAD_LINE_EXAMPLES = 10


@dataclass(frozen=True)
class PartitionJob:
    index: int
    segments: tuple[Segment | ColumnarSegment, ...]
    settings: EncoderSettings
    workers: int
    output_prefixes: dict[str, str]  # json key -> prefix of this partition's .bin/.idx (temporary names)
    skip_bad_lines: bool
    chunk_bytes: int
    dtype: str  # token dtype of the .bin files


@dataclass
class PartitionStats:
    documents: int = 0
    input_bytes: int = 0
    text_bytes: int = 0
    blank_lines: int = 0
    bad_lines: int = 0
    bad_line_examples: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    sequences: dict[str, int] = field(default_factory=dict)


class BadInputError(ValueError):
    """A malformed line or row without --skip-bad-lines."""


def _where(chunk: EncodedChunk, index: int) -> str:
    """``file:line`` (1-based, as editors count) for JSONL; ``file: row N`` (0-based, as pyarrow counts)."""
    if chunk.rows:
        return f"{chunk.path}: row {chunk.first + index}"
    return f"{chunk.path}:{line_number(chunk.path, chunk.segment_start, chunk.first + index)}"


class _Writer:
    def __init__(self, job: PartitionJob):
        self.job = job
        self.builders = {key: MMapIndexedDatasetBuilder(prefix + ".bin", job.dtype)
                         for key, prefix in job.output_prefixes.items()}
        self.stats = PartitionStats()

    def write(self, chunk: EncodedChunk) -> None:
        if chunk.bad_lines and not self.job.skip_bad_lines:
            line, problem = chunk.bad_lines[0]
            such = "rows" if chunk.rows else "lines"
            raise BadInputError(f"{_where(chunk, line)}: {problem} (pass --skip-bad-lines to skip such {such})")
        for line, problem in chunk.bad_lines[:MAX_BAD_LINE_EXAMPLES - len(self.stats.bad_line_examples)]:
            self.stats.bad_line_examples.append(f"{_where(chunk, line)}: {problem}")
        for key, out in chunk.outputs.items():
            self.builders[key].add_documents(out.tokens, out.sequence_lengths, out.sequences_per_document)
        s = self.stats
        s.documents += chunk.documents
        s.input_bytes += chunk.input_bytes
        s.text_bytes += chunk.text_bytes
        s.blank_lines += chunk.blank_lines
        s.bad_lines += len(chunk.bad_lines)

    def finalize(self) -> PartitionStats:
        for key, builder in self.builders.items():
            builder.finalize(self.job.output_prefixes[key] + ".idx")
            self.stats.tokens[key] = builder.num_tokens
            self.stats.sequences[key] = builder.num_sequences
        return self.stats

    def discard(self) -> None:
        for builder in self.builders.values():
            builder.discard()


def _encode_all(job: PartitionJob, executor: ProcessPoolExecutor, writer: _Writer, events: mp.Queue,
                stop: mp.Event) -> None:
    """Submit chunks while fewer than 2 * workers are in flight; write results in input order."""
    pending: deque[Future] = deque()

    def write_oldest() -> None:
        encoded = pending.popleft().result()
        writer.write(encoded)
        tokens = sum(len(o.tokens) for o in encoded.outputs.values())
        events.put(("progress", job.index, (encoded.documents, encoded.input_bytes, encoded.text_bytes, tokens)))
        if stop.is_set():
            raise InterruptedError("stopped because another partition failed")

    for chunk in read_chunks(list(job.segments), job.settings.json_keys, job.chunk_bytes):
        pending.append(executor.submit(encode_chunk, job.settings, chunk))
        if len(pending) >= 2 * job.workers:
            write_oldest()
    while pending:
        write_oldest()


def run_partition(job: PartitionJob, events: mp.Queue, stop: mp.Event) -> None:
    """Process target: encode ``job``, reporting ("progress", index, counts) per chunk, then ("done", index,
    stats) or ("error", index, (message, whether the input or an output path is at fault))."""
    # a worker that dies (e.g. out of memory) breaks the executor with an error instead of hanging it
    executor = ProcessPoolExecutor(job.workers, mp_context=mp.get_context("spawn"))
    writer = None
    try:
        writer = _Writer(job)
        _encode_all(job, executor, writer, events, stop)
        executor.shutdown()
        events.put(("done", job.index, writer.finalize()))
    except BaseException as e:  # every failure goes to the parent, which reports it and cleans up
        executor.shutdown(wait=True, cancel_futures=True)  # drop queued chunks, let running ones end
        if writer is not None:
            writer.discard()
        bad_input = isinstance(e, (BadInputError, ValueError)) or (isinstance(e, OSError)
                                                                    and not isinstance(e, InterruptedError))
        if isinstance(e, BrokenProcessPool):
            message = f"an encoder process died (out of memory or killed?): {e}"
        elif bad_input or isinstance(e, InterruptedError):
            message = str(e)
        else:
            message = traceback.format_exc()
        events.put(("error", job.index, (message, bad_input)))
