"""Merge several Megatron ``.bin/.idx`` datasets into one, in the order given (Megatron's merge_datasets.py).

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document

``--input`` also takes a directory (every prefix in it, sorted by name). All inputs must share the token
dtype (same tokenizer). The output is written under temporary names and renamed when complete.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import dataset_exists, merge_datasets  # noqa: E402
from tools.tool_errors import one_line_errors  # noqa: E402


def input_prefixes(inputs: list[str]) -> list[str]:
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, f[:-4]) for f in os.listdir(item)
                           if f.endswith(".idx") and dataset_exists(os.path.join(item, f[:-4])))
            if not found:
                raise FileNotFoundError(f"--input {item}: the directory holds no .bin/.idx pair")
            prefixes.extend(found)
        elif dataset_exists(item):
            prefixes.append(item)
        else:
            raise FileNotFoundError(f"--input {item}: {item}.bin / {item}.idx not found (give prefixes without "
                                    f"the extension, or a directory)")
    return prefixes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories, merged in order")
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged .bin/.idx")
    args = parser.parse_args(argv)
    with one_line_errors("merge_datasets.py", "give existing .bin/.idx prefixes (or directories of them) and an "
                                              "--output-prefix in a writable directory"):
        prefixes = input_prefixes(args.input)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        merged = merge_datasets(prefixes, args.output_prefix)
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}: {merged.num_documents:,} documents, "
          f"{len(merged):,} sequences, {int(merged.sizes.sum(dtype='int64')):,} tokens")


if __name__ == "__main__":
    main()
