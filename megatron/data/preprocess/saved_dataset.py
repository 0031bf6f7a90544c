"""Folders written by Hugging Face ``datasets``' ``save_to_disk``: their Arrow shards in order, without datasets.

A saved ``Dataset`` is ``state.json`` (the shard names, in order, under ``_data_files``),
``dataset_info.json`` and the shards, Arrow IPC streams read by columnar_reader.py. A saved
``DatasetDict`` (``dataset_dict.json`` and one such folder per split) is refused: the split is the
user's choice.
"""
from __future__ import annotations

import json
import os

FIX = "re-save the dataset with save_to_disk"


def is_saved_dataset(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "state.json"))


def is_saved_dataset_dict(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "dataset_dict.json"))


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e}); {FIX}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object; {FIX}")
    return value


def dataset_dict_error(directory: str) -> ValueError:
    splits = _load(os.path.join(directory, "dataset_dict.json")).get("splits") or []
    example = os.path.join(directory, str(splits[0]) if splits else "train")
    return ValueError(f"--input {directory}: a saved DatasetDict (splits: {', '.join(map(repr, splits)) or 'none'})"
                      f"; give one split's folder, e.g. --input {example}")


def saved_dataset_shards(directory: str) -> list[str]:
    """The Arrow shards of a saved Dataset, in the dataset's row order."""
    state_path = os.path.join(directory, "state.json")
    state = _load(state_path)
    files = state.get("_data_files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("filename"), str)
                                              for f in files):
        raise ValueError(f"{state_path}: no '_data_files' list of shard names (not written by datasets' "
                         f"save_to_disk?); {FIX}")
    if state.get("_indices_data_files"):  # rows in another order than the shards': an old datasets' layout
        raise ValueError(f"{state_path}: the dataset is saved with an indices mapping; re-save it with "
                         f"dataset.flatten_indices().save_to_disk(...)")
    shards = [os.path.join(directory, f["filename"]) for f in files]
    for shard in shards:
        if not os.path.isfile(shard):
            raise ValueError(f"{state_path}: its shard {shard} is missing; copy the whole folder, or {FIX}")
    return shards
