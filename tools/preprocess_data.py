"""Tokenize a corpus (JSONL, .jsonl.gz/.zst, Parquet, saved datasets folders) into Megatron's .bin/.idx datasets
(the command line of megatron.data.preprocess.cli).

    python tools/preprocess_data.py --input 'corpus/*.jsonl.gz' --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --output-prefix data/corpus --workers 8 --partitions 2
"""
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocess.cli import main

if __name__ == "__main__":
    main()
