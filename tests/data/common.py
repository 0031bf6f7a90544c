"""Small Megatron mmap datasets written for the data tests."""
from __future__ import annotations

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder


def make_dataset(path, sizes, seed=0, vocab=1000):
    """Write documents of the given token counts at ``path``; returns the non-empty ones."""
    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(f"{path}.bin", np.uint16)
    docs = []
    for size in sizes:
        tokens = rng.integers(0, vocab, size=size)
        docs.append(tokens)
        builder.add_document(tokens, [size] if size else [])
    builder.finalize(f"{path}.idx")
    return [d for d in docs if len(d)]  # empty documents hold no sequence
