"""Data pipeline benchmark: preprocessing throughput by input format and index-building time. Prints a table.

    python -m benchmarks.bench_data [--copies 3] [--repeats 3] [--workers 2] [--tokens 1e8 1e9]

1. The embedded sample corpus (tools/make_sample_corpus.py), repeated ``--copies`` times, is tokenized by
   tools/preprocess_data.py (our GPT-2 BPE, a byte-level BPE trained on the corpus): as JSONL with 1 and
   ``--workers`` workers, then as .jsonl.zst, Parquet and (when ``datasets`` is installed) a folder written
   by ``datasets``' ``save_to_disk`` with ``--workers`` workers; wall time includes process start-up. Every
   format must give the same token count. Against it: ``datasets``' own ``Dataset.map`` (batched,
   ``num_proc=--workers``) over that folder with the same tokenizer (our GPT2BPETokenizer, eod appended),
   its usual path to token ids (into Arrow cache files, not .bin/.idx); and HF tokenizers' ``encode_batch``
   of the same texts with the same files (Rust, all cores): the practical limit. Each figure is the median
   tokens/s of ``--repeats`` runs.
2. doc_idx + sample_idx + shuffle_idx for each ``--tokens`` count (documents of random length, one epoch at
   sequence lengths 2048 and 256), and Megatron's greedy blend index of two datasets for the same samples.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Callable

import numpy as np
from tokenizers import ByteLevelBPETokenizer

from megatron.data.index_builders import build_blending_indices, build_gpt_indices
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import GPT2BPETokenizer
from tools import preprocess_data
from tools.make_sample_corpus import write_corpus
from tools.train_tokenizer import iter_texts, train_bpe


def _corpus(workdir: str, copies: int) -> tuple[str, list[dict]]:
    single = os.path.join(workdir, "sample.jsonl")
    write_corpus(single)
    with open(single, encoding="utf-8") as f:
        lines = f.readlines()
    path = os.path.join(workdir, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.writelines(lines)
    return path, [json.loads(line) for line in lines] * copies


def _zst(workdir: str, jsonl: str) -> str:
    import zstandard

    path = os.path.join(workdir, "corpus.jsonl.zst")
    with open(jsonl, "rb") as f, open(path, "wb") as out:
        zstandard.ZstdCompressor(level=3).copy_stream(f, out)
    return path


def _parquet(workdir: str, records: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(workdir, "corpus.parquet")
    pq.write_table(pa.Table.from_pylist(records), path)  # pyarrow's defaults: snappy, large row groups
    return path


def _datasets():
    try:
        import datasets
    except ImportError:
        return None
    datasets.disable_progress_bars()
    return datasets


def _saved_dataset(workdir: str, records: list[dict]) -> str:
    path = os.path.join(workdir, "corpus_saved")
    _datasets().Dataset.from_list(records).save_to_disk(path)
    return path


def _median_rate(run: Callable[[], int], repeats: int) -> tuple[float, float, int]:
    """(median tokens/s, median seconds, tokens) of ``repeats`` runs of ``run`` (which returns its tokens)."""
    times, tokens = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        count = run()
        times.append(time.perf_counter() - start)
        if tokens not in (None, count):
            raise RuntimeError(f"token counts differ between runs: {tokens} and {count}")
        tokens = count
    return statistics.median(tokens / t for t in times), statistics.median(times), tokens


def _preprocess(path: str, vocab: str, merges: str, workers: int, prefix: str) -> int:
    preprocess_data.main(["--input", path, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                          "--merge-file", merges, "--append-eod", "--output-prefix", prefix,
                          "--workers", str(workers), "--log-interval", "1000000"])
    return int(MMapIndexedDataset(f"{prefix}_text_document").sizes.sum(dtype=np.int64))


class _MapTokenize:
    """Dataset.map's function: our GPT2BPETokenizer, built once per map process, eod appended."""

    def __init__(self, vocab: str, merges: str):
        self.files = (vocab, merges)
        self.tokenizer = None

    def __call__(self, batch: dict) -> dict:
        if self.tokenizer is None:
            self.tokenizer = GPT2BPETokenizer(*self.files)
        return {"input_ids": [self.tokenizer.tokenize(t) + [self.tokenizer.eod] for t in batch["text"]]}


def _datasets_map(folder: str, vocab: str, merges: str, workers: int) -> int:
    import pyarrow.compute as pc

    datasets = _datasets()
    ds = datasets.load_from_disk(folder)
    out = ds.map(_MapTokenize(vocab, merges), batched=True, num_proc=workers if workers > 1 else None,
                 remove_columns=ds.column_names, load_from_cache_file=False)
    return int(pc.sum(pc.list_value_length(out.data.column("input_ids"))).as_py())


def preprocessing_rows(copies: int, repeats: int, workers: int) -> list[tuple[str, str, str]]:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        path, records = _corpus(workdir, copies)
        vocab, merges, _ = train_bpe(iter_texts([path], ["text"]), 16384, 2, workdir)
        mb = os.path.getsize(path) / 1e6

        def row(name: str, run: Callable[[], int], reference: tuple[float, int] | None = None) -> tuple[float, int]:
            rate, seconds, tokens = _median_rate(run, repeats)
            detail = f"{mb:.1f} MB corpus in {seconds:.1f} s, median of {repeats}"
            if reference is not None:
                if tokens != reference[1]:
                    raise RuntimeError(f"{name}: {tokens} tokens, JSONL gave {reference[1]}")
                detail += f"; {rate / reference[0]:.2f}x JSONL"
            rows.append((name, f"{rate / 1e6:.2f} M tokens/s", detail))
            return rate, tokens

        def ours(label: str, source: str, n: int) -> Callable[[], int]:
            return lambda: _preprocess(source, vocab, merges, n, os.path.join(workdir, f"{label}_w{n}"))

        row("preprocess_data.py, JSONL, 1 worker", ours("jsonl", path, 1))
        jsonl = row(f"preprocess_data.py, JSONL, {workers} workers", ours("jsonl", path, workers))
        for label, package, make in ((".jsonl.zst", "zstandard", lambda: _zst(workdir, path)),
                                     ("Parquet", "pyarrow", lambda: _parquet(workdir, records))):
            name = f"preprocess_data.py, {label}, {workers} workers"
            if importlib.util.find_spec(package) is None:  # optional pins: an offline image may lack them
                rows.append((name, "skipped", f"{package} is not installed (pip install -r requirements.txt)"))
            else:
                row(name, ours(package, make(), workers), jsonl)
        if _datasets() is None:
            rows.append(("datasets save_to_disk folder / Dataset.map", "skipped",
                         "datasets is not installed (pip install -r requirements-dev.txt)"))
        else:
            folder = _saved_dataset(workdir, records)
            row(f"preprocess_data.py, datasets save_to_disk folder, {workers} workers", ours("saved", folder, workers),
                jsonl)
            row(f"datasets {_datasets().__version__} Dataset.map, same tokenizer, num_proc={workers}",
                lambda: _datasets_map(folder, vocab, merges, workers), jsonl)
        hf = ByteLevelBPETokenizer(vocab, merges)
        texts = [r["text"] for r in records]
        row(f"HF tokenizers encode_batch ({os.cpu_count()} cores)",
            lambda: sum(len(e.ids) + 1 for e in hf.encode_batch(texts)), jsonl)  # + eod, as preprocessing appends
    return rows


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def machine_row() -> tuple[str, str, str]:
    """How much faster two CPU-bound processes finish two units of work than one process does one:
    2.0x on two free cores; less when other jobs share the machine (read the worker rows with it)."""
    n = 5_000_000
    start = time.perf_counter()
    _spin(n)
    one = time.perf_counter() - start
    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_spin, [1000, 1000])  # start-up excluded
        start = time.perf_counter()
        pool.map(_spin, [n, n])
        two = time.perf_counter() - start
    return ("this machine: 2 busy processes vs 1 (parallel speedup)", f"{2 * one / two:.2f}x", "2.00x = 2 free cores")


def index_rows(total_tokens: int) -> list[tuple[str, str, str]]:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 2000, size=int(total_tokens / 1000)).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    documents = np.arange(len(sizes), dtype=np.int32)
    rows = []
    for seq_length in (2048, 256):
        samples = (tokens - 1) // seq_length
        start = time.perf_counter()
        built = build_gpt_indices(documents, sizes, samples, seq_length, seed=1234)
        elapsed = time.perf_counter() - start
        rows.append((f"GPT indices, {tokens / 1e6:.0f}M tokens, {len(sizes):,} docs, seq {seq_length}",
                     f"{elapsed:.2f} s", f"{len(built['shuffle_idx']):,} samples"))
        start = time.perf_counter()
        build_blending_indices(np.array([0.3, 0.7]), samples)
        rows.append((f"blend index, 2 datasets, {samples:,} samples", f"{time.perf_counter() - start:.2f} s", ""))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=3, help="sample corpus repetitions to tokenize")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each preprocessing row (median reported)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the format rows (and Dataset.map)")
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e8, 1e9],
                        help="token counts for the index-building benchmark")
    args = parser.parse_args(argv)
    rows = [machine_row()] + preprocessing_rows(args.copies, args.repeats, args.workers)
    rows += [row for tokens in args.tokens for row in index_rows(int(tokens))]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'benchmark':<{width}}  {'result':>18}  detail")
    print("-" * (width + 40))
    for name, result, detail in rows:
        print(f"{name:<{width}}  {result:>18}  {detail}")


if __name__ == "__main__":
    main()
