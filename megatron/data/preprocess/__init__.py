"""Corpus (JSONL, Parquet, Arrow, saved datasets) -> Megatron .bin/.idx preprocessing; the command line is
cli.py (ptm-preprocess, tools/preprocess_data.py)."""
