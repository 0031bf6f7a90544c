"""Megatron's GPT dataset: fixed-length samples cut from a range of an indexed dataset's sequences.

Item i is ``{"text": int64[seq_length + 1]}``: sample ``shuffle_idx[i]``, read across document
boundaries in ``doc_idx`` order (see ``index_builders``). Like Megatron, every sequence of the
``.bin/.idx`` pair counts as a document here (with ``--split-sentences`` data, a sentence).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from megatron.data.index_builders import build_gpt_indices, num_epochs_needed
from megatron.data.index_cache import load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.utils import PicklesMemmapsByPath, log_rank0

INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def cache_dirs(prefix: str, data_cache_path: str | None) -> list[str]:
    """Where cached indices are looked for: beside the data first, then ``--data-cache-path`` (built there)."""
    dirs = [os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")]
    if data_cache_path is not None:
        dirs.append(os.path.abspath(data_cache_path))
    return dirs


class GPTDataset(PicklesMemmapsByPath, torch.utils.data.Dataset):
    """``num_samples`` (or a few more: whole epochs) samples of sequences ``documents`` of ``indexed``."""

    def __init__(self, name: str, prefix: str, indexed: MMapIndexedDataset, documents: range,
                 num_samples: int, seq_length: int, seed: int, data_cache_path: str | None,
                 timeout_minutes: float):
        if seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.name, self.prefix, self.indexed = name, prefix, indexed
        self.seq_length = seq_length
        docs = np.arange(documents.start, documents.stop, dtype=np.int32)
        sizes = indexed.sizes
        tokens = int(sizes[documents.start:documents.stop].sum(dtype=np.int64))
        if tokens == 0:
            raise ValueError(f"the {name} split of {prefix} (sequences {documents.start}..{documents.stop - 1}) "
                             f"has no tokens; give more data or change --split")
        epochs = num_epochs_needed(tokens, seq_length, num_samples)
        size_hash = hashlib.md5(np.ascontiguousarray(sizes[documents.start:documents.stop]).tobytes()).hexdigest()
        description = "\n".join([
            "GPT dataset indices", f"data prefix: {os.path.abspath(prefix)}", f"dataset name: {name}",
            f"documents: {documents.start}..{documents.stop} (sizes md5 {size_hash})",
            f"number of samples: {num_samples}", f"sequence length: {seq_length}", f"random seed: {seed}", ""])
        cached = load_or_build(
            description, f"{os.path.basename(prefix)}_{name}_", INDEX_NAMES, cache_dirs(prefix, data_cache_path),
            lambda: build_gpt_indices(docs, sizes, num_samples, seq_length, seed), timeout_minutes)
        self.doc_idx = cached.arrays["doc_idx"]
        self.sample_idx = cached.arrays["sample_idx"]
        self.shuffle_idx = cached.arrays["shuffle_idx"]
        self.built_indices = cached.built
        self.description = description
        log_rank0(f" > {name} split of {prefix}: {len(docs)} documents, {tokens} tokens, {epochs} epoch(s), "
                  f"{len(self)} samples of {seq_length + 1} tokens ({num_samples} requested)")

    def __len__(self) -> int:
        return self.shuffle_idx.shape[0]

    def sample(self, index: int) -> np.ndarray:
        """Unshuffled sample ``index`` (in sample_idx order)."""
        first_doc, first_offset = (int(v) for v in self.sample_idx[index])
        last_doc, last_offset = (int(v) for v in self.sample_idx[index + 1])
        if first_doc == last_doc:
            return np.array(self.indexed.get(int(self.doc_idx[first_doc]), first_offset,
                                             last_offset - first_offset + 1), dtype=np.int64)
        parts = [self.indexed.get(int(self.doc_idx[first_doc]), first_offset)]
        parts += [self.indexed.get(int(self.doc_idx[i])) for i in range(first_doc + 1, last_doc)]
        parts.append(self.indexed.get(int(self.doc_idx[last_doc]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {self.name} dataset of {len(self)} samples")
        return {"text": self.sample(int(self.shuffle_idx[idx]))}
