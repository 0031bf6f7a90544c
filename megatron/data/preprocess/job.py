"""One preprocessing job: the input in partitions processed at the same time, merged in input order.

The input is expanded and planned first (inputs.py), which checks every Parquet and Arrow file's metadata
before anything is written. Each partition runs in its own process with its share of the encoder workers
(partition.py); the Punkt model for ``--split-sentences`` is found or trained once, here. Outputs are
written under temporary names and merged or renamed into place only when every partition succeeded.
Progress goes to stderr, the summary to stdout.
"""
from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import dataclass

from megatron.data.indexed_dataset import best_fitting_dtype, install_dataset, merge_datasets
from megatron.data.preprocess.columnar_reader import ColumnarSegment
from megatron.data.preprocess.document_encoder import EncoderSettings, records
from megatron.data.preprocess.inputs import expand_inputs, plan_partitions, read_chunks
from megatron.data.preprocess.jsonl_reader import Segment
from megatron.data.preprocess.partition import BadInputError, PartitionJob, PartitionStats, run_partition
from megatron.tokenizer import build_tokenizer
from megatron.training.arguments.tokenizer import tokenizer_config_from_args

CHUNK_BYTES = 1 << 20


def _sentence_splitter_module():
    """The nltk-based splitter; nltk is imported only here, so preprocessing without sentences needs none."""
    try:
        from megatron.data.preprocess import sentence_splitter
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "nltk":
            raise
        raise ValueError("--split-sentences needs nltk, which is not installed: pip install nltk (or run "
                         "without --split-sentences)") from None
    return sentence_splitter


def _punkt_params(args: argparse.Namespace, segments: list[Segment | ColumnarSegment]) -> bytes | None:
    if not args.split_sentences:
        return None
    splitter = _sentence_splitter_module()
    params = splitter.installed_punkt_params(args.lang)
    if params is not None:
        print(f"splitting sentences with the installed nltk Punkt model for {args.lang}", file=sys.stderr)
        return splitter.punkt_params_blob(params)
    def texts():  # only the Punkt sample is parsed here; the workers parse everything else
        for chunk in read_chunks(segments, tuple(args.json_keys), CHUNK_BYTES):
            for _, record, _ in records(chunk):  # bad lines are reported by the workers with their position
                for key in args.json_keys:
                    if record is not None and isinstance(record.get(key), str):
                        yield record[key]

    start = time.perf_counter()
    params, used = splitter.train_punkt_params(texts())
    print(f"nltk Punkt data for {args.lang} is not installed, and nothing is downloaded: trained Punkt on the "
          f"first {used / 1e6:.1f} MB of the input instead ({time.perf_counter() - start:.1f}s). To use the "
          f"pretrained model install it first: python -m nltk.downloader punkt_tab", file=sys.stderr)
    return splitter.punkt_params_blob(params)


@dataclass
class _Progress:
    total_bytes: int
    log_interval: int
    start: float = 0.0
    documents: int = 0
    input_bytes: int = 0
    text_bytes: int = 0
    tokens: int = 0
    next_report: int = 0

    def update(self, documents: int, input_bytes: int, text_bytes: int, tokens: int) -> None:
        self.documents += documents
        self.input_bytes += input_bytes
        self.text_bytes += text_bytes
        self.tokens += tokens
        if self.documents >= self.next_report:
            self.next_report = (self.documents // self.log_interval + 1) * self.log_interval
            self.report()

    def report(self) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        done = min(self.input_bytes / max(self.total_bytes, 1), 1.0)
        eta = elapsed * (1 - done) / done if done > 0 else float("nan")
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        print(f"processed {self.documents:,} documents | {self.documents / elapsed:,.0f} docs/s | "
              f"{self.text_bytes / elapsed / 1e6:.2f} MB/s | {self.tokens / elapsed / 1e6:.2f}M tokens/s | "
              f"{100 * done:.1f}% of input | ETA {eta_text}", file=sys.stderr, flush=True)


def _remove_temporaries(finals: dict[str, str], tag: str) -> None:
    for final in finals.values():
        for path in glob.glob(glob.escape(final) + f".*{tag}*"):
            os.remove(path)


def _run_partitions(jobs: list[PartitionJob], progress: _Progress) -> list[PartitionStats]:
    ctx = mp.get_context("spawn")
    events, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=run_partition, args=(job, events, stop)) for job in jobs]
    for p in procs:
        p.start()
    stats: dict[int, PartitionStats] = {}
    errors: dict[int, tuple[str, bool]] = {}
    try:
        while len(stats) + len(errors) < len(jobs):
            try:
                kind, index, payload = events.get(timeout=1.0)
            except queue.Empty:
                for i, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and i not in stats and i not in errors:
                        errors[i] = (f"partition {i} died (exit code {p.exitcode}); out of memory or killed?", False)
                        stop.set()
                continue
            if kind == "progress":
                progress.update(*payload)
            elif kind == "done":
                stats[index] = payload
            else:
                errors[index] = payload
                stop.set()
    finally:
        stop.set()  # no-op for finished partitions; stops the others on error or interrupt
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:  # report the cause, not the partitions stopped because of it
        causes = [e for _, e in sorted(errors.items()) if "another partition failed" not in e[0]]
        message, bad_input = (causes or list(errors.values()))[0]
        raise BadInputError(message) if bad_input else RuntimeError(message)
    return [stats[i] for i in range(len(jobs))]


def _prepare_output_dir(output_prefix: str) -> None:
    """Create the directory of ``--output-prefix``; a path that cannot hold the outputs is one clear error."""
    directory = os.path.dirname(os.path.abspath(output_prefix))
    fix = "choose an --output-prefix in a writable directory"
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        raise BadInputError(f"--output-prefix {output_prefix}: {directory} exists and is not a directory; {fix}") \
            from None
    except OSError as e:
        raise BadInputError(f"--output-prefix {output_prefix}: cannot create {e.filename or directory} "
                            f"({e.strerror}); {fix}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        read_only = os.statvfs(directory).f_flag & os.ST_RDONLY
        why = "it is on a read-only filesystem" if read_only else "it is not writable"
        raise BadInputError(f"--output-prefix {output_prefix}: cannot write to {directory} ({why}); {fix}")


def _refuse_empty(stats: list[PartitionStats], patterns: list[str], keys: list[str]) -> None:
    """A dataset without documents or tokens only fails later, in the trainer: refuse it here."""
    documents = sum(s.documents for s in stats)
    names = " ".join(patterns)
    if documents == 0:
        raise BadInputError(f"--input {names}: no documents (the input is empty or every line or row was blank or "
                            f"skipped); give JSONL with one {{\"{keys[0]}\": ...}} object per line, or Parquet or "
                            f"Arrow with a {keys[0]!r} column")
    for key in keys:
        if sum(s.tokens[key] for s in stats) == 0:
            raise BadInputError(f"--input {names}: {documents:,} documents but no tokens under the key {key!r} "
                                f"(every {key!r} is empty); check --json-keys or the input")


def preprocess(args: argparse.Namespace) -> dict[str, str]:
    """Run the whole job; returns json key -> output prefix."""
    files = expand_inputs(args.input)
    parts = plan_partitions(files, tuple(args.json_keys), args.partitions)  # also checks Parquet/Arrow metadata
    tokenizer_cfg = tokenizer_config_from_args(args)
    tokenizer = build_tokenizer(tokenizer_cfg)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    settings = EncoderSettings(tokenizer_cfg, tuple(args.json_keys), args.append_eod,
                               _punkt_params(args, [s for part in parts for s in part]), args.keep_newlines)
    level = "sentence" if args.split_sentences else "document"
    finals = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
    _prepare_output_dir(args.output_prefix)
    tag = f"tmp-{os.getpid()}"
    total_bytes = sum(os.path.getsize(f.path) for f in files)
    jobs = [PartitionJob(index=i, segments=tuple(segments), settings=settings,
                         workers=args.workers // args.partitions + (i < args.workers % args.partitions),
                         output_prefixes={k: f"{f}.part{i}.{tag}" for k, f in finals.items()},
                         skip_bad_lines=args.skip_bad_lines, chunk_bytes=CHUNK_BYTES, dtype=dtype.name)
            for i, segments in enumerate(parts)]
    formats = ", ".join(sorted({f.format for f in files}))
    print(f"tokenizing {len(files)} file(s) ({formats}), {total_bytes / 1e6:.1f} MB, with "
          f"{tokenizer} into {', '.join(finals.values())} ({dtype.name}); {args.workers} worker(s), "
          f"{args.partitions} partition(s)", file=sys.stderr)
    progress = _Progress(total_bytes=total_bytes, log_interval=args.log_interval,
                         start=time.perf_counter())
    try:
        stats = _run_partitions(jobs, progress)
        _refuse_empty(stats, args.input, args.json_keys)
        for key, final in finals.items():
            shards = [job.output_prefixes[key] for job in jobs]
            if len(shards) == 1:
                install_dataset(shards[0], final)
            else:
                merge_datasets(shards, final)
    finally:
        _remove_temporaries(finals, tag)
    _summary(stats, finals, time.perf_counter() - progress.start)
    return finals


def _summary(stats: list[PartitionStats], finals: dict[str, str], elapsed: float) -> None:
    documents = sum(s.documents for s in stats)
    for key, final in finals.items():
        tokens = sum(s.tokens[key] for s in stats)
        sequences = sum(s.sequences[key] for s in stats)
        print(f"{final}.bin/.idx: {documents:,} documents, {sequences:,} sequences, {tokens:,} tokens")
    blank = sum(s.blank_lines for s in stats)
    bad = sum(s.bad_lines for s in stats)
    if blank:
        print(f"skipped {blank:,} blank line(s)")
    if bad:
        examples = [e for s in stats for e in s.bad_line_examples][:10]
        print(f"skipped {bad:,} bad line(s) or row(s) (--skip-bad-lines); first ones:\n  " + "\n  ".join(examples))
    text_mb = sum(s.text_bytes for s in stats) / 1e6
    print(f"done in {elapsed:.1f}s ({documents / elapsed:,.0f} docs/s, {text_mb / elapsed:.2f} MB/s)")
