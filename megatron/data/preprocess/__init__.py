"""JSONL -> Megatron .bin/.idx preprocessing (used by tools/preprocess_data.py)."""
