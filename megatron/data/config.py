"""Where the training data comes from (``DataConfig``) and how a blend of datasets is written."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron.data.index_builders import split_boundaries
from megatron.data.indexed_dataset import dataset_exists

Blend = tuple[tuple[float, str], ...]  # (weight, prefix) pairs; weights not yet normalised


def parse_blend(values: Sequence[str] | None, flag: str) -> Blend | None:
    """``[A]`` -> ((1, A),); ``[w1, A, w2, B]`` -> ((w1, A), (w2, B)); ``[A, B]`` -> equal weights."""
    if not values:
        return None
    values = list(values)
    if len(values) == 1:
        return ((1.0, values[0]),)

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    weights = [number(v) for v in values[0::2]]
    if len(values) % 2 == 0 and all(w is not None for w in weights) and not any(number(v) is not None
                                                                                 for v in values[1::2]):
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"{flag}: weights must be non-negative with a positive sum, got {weights}")
        return tuple(zip(weights, values[1::2]))
    if all(number(v) is None for v in values):
        return tuple((1.0, v) for v in values)
    raise ValueError(f"{flag} {' '.join(values)}: give one prefix, prefixes only, or weight/prefix pairs "
                     f"like '0.3 PREFIX_A 0.7 PREFIX_B'")


@dataclass(frozen=True)
class DataConfig:
    data_path: Blend | None = None  # one dataset or blend, split into train/valid/test by ``split``
    split: str = "969,30,1"  # train,valid,test proportions of the documents of each ``data_path`` dataset
    train_data_path: Blend | None = None  # training data given separately (instead of ``data_path``)
    valid_data_path: Blend | None = None  # validation data, whole datasets (no split)
    test_data_path: Blend | None = None  # test data, whole datasets (no split)
    data_cache_path: str | None = None  # directory of the cached sample indices (None: index-cache/ beside the data)
    mock_data: bool = False  # synthetic tokens; no files needed
    num_workers: int = 2  # data loader worker processes
    eod_mask_loss: bool = False  # no loss on end-of-document tokens
    reset_position_ids: bool = False  # positions restart after each end-of-document token
    reset_attention_mask: bool = False  # tokens attend only within their own document
    build_timeout_minutes: float = 10.0  # how long other ranks wait for rank 0 to build the index cache

    def describe(self) -> str:
        """The data flags in use, for messages about the data."""
        if self.mock_data:
            return "--mock-data"
        flags = (("--data-path", self.data_path), ("--train-data-path", self.train_data_path),
                 ("--valid-data-path", self.valid_data_path), ("--test-data-path", self.test_data_path))
        return ", ".join(f"{flag} {' '.join(p for _, p in blend)}" for flag, blend in flags if blend)

    def __post_init__(self):
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.mock_data:
            return
        separate = (self.train_data_path, self.valid_data_path, self.test_data_path)
        if self.data_path is None and not any(separate):
            raise ValueError("no training data: pass --data-path (or --train-data-path/--valid-data-path/"
                             "--test-data-path), or --mock-data for synthetic data")
        if self.data_path is not None and any(separate):
            raise ValueError("--data-path cannot be combined with --train/valid/test-data-path; use one or the other")
        if self.data_path is not None:
            split_boundaries(self.split, 1)  # validates --split early
        for flag, blend in (("--data-path", self.data_path), ("--train-data-path", self.train_data_path),
                            ("--valid-data-path", self.valid_data_path), ("--test-data-path", self.test_data_path)):
            for _, prefix in blend or ():
                if not dataset_exists(prefix):
                    raise ValueError(f"{flag}: {prefix}.bin / {prefix}.idx not found (a prefix names "
                                            f"the output of tools/preprocess_data.py without the extension)")
