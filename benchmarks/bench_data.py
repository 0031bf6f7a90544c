"""Data pipeline benchmark: preprocessing throughput and index-building time. Prints a table.

    python -m benchmarks.bench_data [--copies 3] [--tokens 1e8 1e9]

1. The embedded sample corpus (tools/make_sample_corpus.py), repeated ``--copies`` times, is tokenized by
   tools/preprocess_data.py (our GPT-2 BPE, a byte-level BPE trained on the corpus) with 1 and 2 workers;
   wall time includes process start-up. The reference is HF tokenizers' own ``encode_batch`` of the same
   texts with the same files (Rust, all cores): the practical limit.
2. doc_idx + sample_idx + shuffle_idx for each ``--tokens`` count (documents of random length, one epoch at
   sequence lengths 2048 and 256), and Megatron's greedy blend index of two datasets for the same samples.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np
from tokenizers import ByteLevelBPETokenizer

from megatron.data.index_builders import build_blending_indices, build_gpt_indices
from megatron.data.indexed_dataset import MMapIndexedDataset
from tools import preprocess_data
from tools.make_sample_corpus import write_corpus
from tools.train_tokenizer import iter_texts, train_bpe


def _corpus(workdir: str, copies: int) -> tuple[str, list[str]]:
    single = os.path.join(workdir, "sample.jsonl")
    write_corpus(single)
    with open(single, encoding="utf-8") as f:
        lines = f.readlines()
    path = os.path.join(workdir, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.writelines(lines)
    return path, [json.loads(line)["text"] for line in lines] * copies


def _preprocess(path: str, vocab: str, merges: str, workers: int, prefix: str) -> tuple[float, int]:
    start = time.perf_counter()
    preprocess_data.main(["--input", path, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                          "--merge-file", merges, "--append-eod", "--output-prefix", prefix,
                          "--workers", str(workers), "--log-interval", "1000000"])
    elapsed = time.perf_counter() - start
    return elapsed, int(MMapIndexedDataset(f"{prefix}_text_document").sizes.sum(dtype=np.int64))


def preprocessing_rows(copies: int) -> list[tuple[str, str, str]]:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        path, texts = _corpus(workdir, copies)
        vocab, merges, _ = train_bpe(iter_texts([path], ["text"]), 16384, 2, workdir)
        mb = os.path.getsize(path) / 1e6
        for workers in (1, 2):
            elapsed, tokens = _preprocess(path, vocab, merges, workers, os.path.join(workdir, f"w{workers}"))
            rows.append((f"preprocess_data.py, GPT2BPETokenizer, {workers} worker(s)",
                         f"{tokens / elapsed / 1e6:.2f} M tokens/s", f"{mb:.1f} MB in {elapsed:.1f} s"))
        hf = ByteLevelBPETokenizer(vocab, merges)
        start = time.perf_counter()
        hf_tokens = sum(len(e.ids) + 1 for e in hf.encode_batch(texts))  # + eod, as preprocessing appends
        elapsed = time.perf_counter() - start
        rows.append((f"HF tokenizers encode_batch ({os.cpu_count()} cores)",
                     f"{hf_tokens / elapsed / 1e6:.2f} M tokens/s", f"{mb:.1f} MB in {elapsed:.1f} s"))
        if hf_tokens != tokens:
            raise RuntimeError(f"token counts differ: preprocessing {tokens}, HF {hf_tokens}")
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
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e8, 1e9],
                        help="token counts for the index-building benchmark")
    args = parser.parse_args(argv)
    rows = [machine_row()] + preprocessing_rows(args.copies)
    rows += [row for tokens in args.tokens for row in index_rows(int(tokens))]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'benchmark':<{width}}  {'result':>18}  detail")
    print("-" * (width + 40))
    for name, result, detail in rows:
        print(f"{name:<{width}}  {result:>18}  {detail}")


if __name__ == "__main__":
    main()
