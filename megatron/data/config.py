"""Data flags (Megatron names), the typed ``DataConfig`` built from them, and blend parsing."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from megatron.data.index_builders import split_boundaries
from megatron.data.indexed_dataset import dataset_exists

Blend = tuple[tuple[float, str], ...]  # (weight, prefix) pairs; weights not yet normalised


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="one dataset prefix, or weights and prefixes: 0.3 A 0.7 B (split by --split)")
    group.add_argument("--split", default="969,30,1",
                       help="train,valid,test proportions of the documents of each --data-path dataset")
    group.add_argument("--train-data-path", nargs="*", default=None, help="train data (prefix or blend)")
    group.add_argument("--valid-data-path", nargs="*", default=None, help="validation data (prefix or blend)")
    group.add_argument("--test-data-path", nargs="*", default=None, help="test data (prefix or blend)")
    group.add_argument("--data-cache-path", default=None,
                       help="directory for the cached sample indices (default: index-cache/ beside the data)")
    group.add_argument("--mock-data", action="store_true", help="synthetic data; no files needed")
    group.add_argument("--num-workers", type=int, default=2, help="data loader worker processes")
    group.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    group.add_argument("--reset-position-ids", action="store_true", help="positions restart after each eod")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="tokens attend only within their own document")
    return parser


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
    data_path: Blend | None = None
    split: str = "969,30,1"
    train_data_path: Blend | None = None
    valid_data_path: Blend | None = None
    test_data_path: Blend | None = None
    data_cache_path: str | None = None
    mock_data: bool = False
    num_workers: int = 2
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    build_timeout_minutes: float = 10.0  # how long other ranks wait for rank 0 to build the index cache

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


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    timeout = getattr(args, "distributed_timeout_minutes", None)
    return DataConfig(
        data_path=parse_blend(args.data_path, "--data-path"), split=args.split,
        train_data_path=parse_blend(args.train_data_path, "--train-data-path"),
        valid_data_path=parse_blend(args.valid_data_path, "--valid-data-path"),
        test_data_path=parse_blend(args.test_data_path, "--test-data-path"),
        data_cache_path=args.data_cache_path, mock_data=args.mock_data, num_workers=args.num_workers,
        eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        build_timeout_minutes=float(timeout) if timeout else DataConfig.build_timeout_minutes)
