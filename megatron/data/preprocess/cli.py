"""Tokenize a corpus into Megatron's ``<output-prefix>_<key>_document.{bin,idx}`` (``_sentence`` when splitting).

    python tools/preprocess_data.py --input 'corpus/*.jsonl.gz' --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --output-prefix data/corpus --workers 8 --partitions 2

--input takes JSONL (plain, .gz, .zst), Parquet (.parquet), Arrow (.arrow), folders written by Hugging
Face datasets' save_to_disk, and globs or folders of shards of any of these; --json-keys names the keys
or columns. The same documents give the same bytes in every format.

The input is streamed (memory stays flat) in ``--partitions`` contiguous parts processed at the same
time, with ``--workers`` encoder processes shared among them; parts are merged in input order, so the
output does not depend on either number. Everything is written under temporary names and renamed only
when complete. A malformed line (or a null in a row) is an error naming its file and line (or row) unless
``--skip-bad-lines``; a missing or non-text column is refused before anything is written, and a damaged
file stops the run with nothing left behind.
"""
from __future__ import annotations

import argparse
import sys

from megatron.data.preprocess.job import preprocess
from megatron.training.arguments.tokenizer import add_tokenizer_args


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True,
                       help="JSONL (.gz, .zst), Parquet or Arrow files, saved datasets folders, globs or folders")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys (JSONL) or columns (Parquet, Arrow) to tokenize, one output each")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (nltk Punkt)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences, keep newlines after sentence ends")
    group.add_argument("--lang", default="english", help="language of the installed Punkt model to use")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip (and count) malformed lines or rows instead of stopping at the first")
    add_tokenizer_args(parser)
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    group.add_argument("--append-eod", action="store_true", help="end every non-empty document with eod")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="encoder processes in all")
    group.add_argument("--partitions", type=int, default=1, help="parts of the input processed concurrently")
    group.add_argument("--log-interval", type=int, default=1000, help="report progress every N documents")
    args = parser.parse_args(argv)
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    if args.workers < 1 or args.partitions < 1 or args.log_interval < 1:
        parser.error("--workers, --partitions and --log-interval must be at least 1")
    if args.partitions > args.workers:
        parser.error(f"--partitions {args.partitions} exceeds --workers {args.workers}: every partition needs "
                     f"at least one worker")
    if args.keep_newlines and not args.split_sentences:
        print("note: --keep-newlines only matters with --split-sentences (text is tokenized as is otherwise)",
              file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> None:
    """Bad input or an unusable output path: one line, exit code 2; a failed run (a worker died): exit code 1."""
    args = get_args(argv)
    try:
        preprocess(args)
    except (ValueError, OSError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        sys.exit(1)

