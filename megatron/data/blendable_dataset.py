"""Megatron's blend of several datasets by weight (``--data-path 0.3 A 0.7 B``)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from megatron.data.index_builders import build_blending_indices
from megatron.data.index_cache import load_or_build
from megatron.data.utils import PicklesMemmapsByPath, log_rank0

BLEND_OVERSAMPLE = 1.005  # Megatron's margin so a greedy blend never runs a component dataset dry


def normalized_weights(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    return [w / total for w in weights]


def samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """Megatron's per-dataset sample counts: ceil(w * N * 1.005) of normalised weights."""
    return [int(math.ceil(w * num_samples * BLEND_OVERSAMPLE)) for w in normalized_weights(weights)]


class BlendableDataset(PicklesMemmapsByPath, torch.utils.data.Dataset):
    """Sample i is ``datasets[dataset_index[i]][dataset_sample_index[i]]`` (Megatron's greedy order)."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int,
                 cache_dirs: list[str], timeout_minutes: float):
        self.datasets = list(datasets)
        if len(self.datasets) != len(weights):
            raise ValueError(f"{len(self.datasets)} datasets but {len(weights)} weights")
        self.weights = normalized_weights(weights)
        self.size = size
        parts = [getattr(d, "description", f"{type(d).__name__} of {len(d)} samples") for d in self.datasets]
        description = "\n".join(["Blended dataset", f"weights: {self.weights}", f"size: {size}"] +
                                [f"component {i}:\n{p}" for i, p in enumerate(parts)])
        cached = load_or_build(description, "blend_", ("dataset_index", "dataset_sample_index"),
                               cache_dirs, lambda: build_blending_indices(np.array(self.weights), size),
                               timeout_minutes)
        self.dataset_index = cached.arrays["dataset_index"]
        self.dataset_sample_index = cached.arrays["dataset_sample_index"]
        self.built_indices = cached.built
        self.description = description
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, dataset in enumerate(self.datasets):
            if counts[d] > len(dataset):
                raise ValueError(f"the blend draws {counts[d]} samples from component {d}, which has "
                                 f"{len(dataset)}; build the components with samples_per_dataset()")
        log_rank0(f" > blended {len(self.datasets)} datasets, {size} samples, drawn "
                  f"{', '.join(f'{c / max(size, 1):.4f}' for c in counts)} for weights "
                  f"{', '.join(f'{w:.4f}' for w in self.weights)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
