"""``build_train_valid_test_datasets``: the trainer's entry point to data (Megatron's semantics)."""
from __future__ import annotations

import os

import torch

from megatron.data.blendable_dataset import BlendableDataset, samples_per_dataset
from megatron.data.config import Blend, DataConfig
from megatron.data.errors import DataError
from megatron.data.gpt_dataset import GPTDataset, cache_dirs
from megatron.data.index_builders import split_boundaries
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.mock_dataset import MockGPTDataset
from megatron.data.utils import log_rank0

SPLITS = ("train", "valid", "test")


class _Builder:
    """Opens each prefix once and builds GPT / blended datasets with the shared settings."""

    def __init__(self, cfg: DataConfig, seq_length: int, seed: int):
        self.cfg, self.seq_length, self.seed = cfg, seq_length, seed
        self._indexed: dict[str, MMapIndexedDataset] = {}

    def indexed(self, prefix: str) -> MMapIndexedDataset:
        """The dataset at ``prefix``; one without documents, or with fewer tokens than one sample, is refused."""
        if prefix not in self._indexed:
            ds = MMapIndexedDataset(prefix)
            if ds.num_documents == 0:
                raise DataError(f"{prefix}.bin/.idx holds no documents (was the input of tools/preprocess_data.py "
                                f"empty?); preprocess a non-empty corpus or remove this prefix from the data flags")
            tokens = int(ds.sizes.sum(dtype="int64"))
            if tokens < self.seq_length + 1:
                raise DataError(f"{prefix}.bin/.idx holds {tokens} tokens, fewer than one sample of "
                                f"{self.seq_length + 1} (--seq-length {self.seq_length} + 1); give it more data "
                                f"or use a smaller --seq-length")
            self._indexed[prefix] = ds
        return self._indexed[prefix]

    def gpt(self, split: str, prefix: str, documents: range, num_samples: int) -> GPTDataset:
        return GPTDataset(split, prefix, self.indexed(prefix), documents, num_samples, self.seq_length,
                          self.seed, self.cfg.data_cache_path, self.cfg.build_timeout_minutes)

    def blend(self, split: str, blend: Blend, num_samples: int,
              documents_of: dict[str, range]) -> torch.utils.data.Dataset | None:
        """One dataset (GPT or blend) for ``split`` over ``documents_of[prefix]`` of each prefix."""
        prefixes = [p for _, p in blend]
        non_empty = [p for p in prefixes if len(documents_of[p]) > 0]
        if num_samples == 0:
            return None
        if not non_empty:
            if split == "train":  # the trainer cannot start without training samples
                raise DataError(f"the train split of {', '.join(prefixes)} has no documents "
                                f"({', '.join(str(len(self.indexed(p))) for p in prefixes)} in all, --split "
                                f"{self.cfg.split}); give the train split a larger share in --split or use more data")
            return None
        if len(non_empty) != len(prefixes):
            empty = sorted(set(prefixes) - set(non_empty))
            raise ValueError(f"the {split} split is empty for {', '.join(empty)} but not for the other blended "
                             f"datasets; change --split or the blend")
        if len(blend) == 1:
            return self.gpt(split, prefixes[0], documents_of[prefixes[0]], num_samples)
        weights = [w for w, _ in blend]
        counts = samples_per_dataset(weights, num_samples)
        parts = [self.gpt(split, p, documents_of[p], n) for p, n in zip(prefixes, counts)]
        return BlendableDataset(parts, weights, sum(counts), cache_dirs(prefixes[0], self.cfg.data_cache_path),
                                self.cfg.build_timeout_minutes)


def build_train_valid_test_datasets(cfg: DataConfig, tokenizer, seq_length: int,
                                    num_samples: tuple[int, int, int], seed: int, *,
                                    vocab_size: int | None = None):
    """(train, valid, test): torch Datasets of ``{"text": int64[seq_length + 1]}``, or None when not needed.

    A split is None when it is asked for 0 samples or has no documents. With ``cfg.mock_data`` the datasets
    are synthetic (``vocab_size`` or the tokenizer's); otherwise indices are built and cached on global
    rank 0 while the other ranks wait, then memory-mapped by all.
    """
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three non-negative counts (train, valid, test), got {num_samples}")
    if cfg.mock_data:
        vocab = vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)
        if vocab is None:
            raise ValueError("--mock-data needs a vocabulary size: pass vocab_size or a tokenizer")
        eod = getattr(tokenizer, "eod", None)
        return tuple(MockGPTDataset(split, n, seq_length, vocab, seed, eod) if n > 0 else None
                     for split, n in zip(SPLITS, num_samples))
    try:
        return _build_real(cfg, seq_length, num_samples, seed)
    except DataError:
        raise
    except (ValueError, FileNotFoundError) as e:  # unreadable or inconsistent files, bad --split or blend
        raise DataError(str(e)) from None


def _build_real(cfg: DataConfig, seq_length: int, num_samples: tuple[int, int, int], seed: int):
    builder = _Builder(cfg, seq_length, seed)
    if cfg.data_path is not None:
        documents_of: list[dict[str, range]] = [{}, {}, {}]
        for _, prefix in cfg.data_path:
            bounds = split_boundaries(cfg.split, len(builder.indexed(prefix)))
            log_rank0(f" > {os.path.basename(prefix)}: documents train [{bounds[0]}, {bounds[1]}), "
                      f"valid [{bounds[1]}, {bounds[2]}), test [{bounds[2]}, {bounds[3]})")
            for i in range(3):
                documents_of[i][prefix] = range(bounds[i], bounds[i + 1])
        return tuple(builder.blend(split, cfg.data_path, n, documents_of[i])
                     for i, (split, n) in enumerate(zip(SPLITS, num_samples)))
    out = []
    for split, blend, n in zip(SPLITS, (cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path), num_samples):
        if blend is None:
            out.append(None)
            continue
        everything = {p: range(0, len(builder.indexed(p))) for _, p in blend}
        out.append(builder.blend(split, blend, n, everything))
    return tuple(out)
