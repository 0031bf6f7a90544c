"""Data flags -> ``DataConfig`` (no torch: the preprocessing tools import this)."""
from __future__ import annotations

import argparse

from megatron.data.config import DataConfig, parse_blend


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
    group.add_argument("--data-impl", choices=["mmap", "infer", "lazy", "cached"], default="mmap",
                       help="Megatron-DeepSpeed: the .bin/.idx format; mmap (and infer) only")
    group.add_argument("--num-workers", type=int, default=2, help="data loader worker processes")
    group.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    group.add_argument("--reset-position-ids", action="store_true", help="positions restart after each eod")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="tokens attend only within their own document")
    return parser


def data_config_from_args(args: argparse.Namespace, build_timeout_minutes: float | None = None) -> DataConfig:
    """``build_timeout_minutes``: how long other ranks wait for rank 0 to build the index cache (None or 0:
    DataConfig's default)."""
    if args.data_impl not in ("mmap", "infer"):
        raise ValueError(f"--data-impl {args.data_impl}: only the mmap format is read here; use --data-impl mmap "
                         "(tools/preprocess_data.py writes it)")
    return DataConfig(
        # A script that quotes the value inside an array expansion passes the quotes on; Megatron ignores them.
        data_path=parse_blend(args.data_path, "--data-path"), split=args.split.strip("'\""),
        train_data_path=parse_blend(args.train_data_path, "--train-data-path"),
        valid_data_path=parse_blend(args.valid_data_path, "--valid-data-path"),
        test_data_path=parse_blend(args.test_data_path, "--test-data-path"),
        data_cache_path=args.data_cache_path, mock_data=args.mock_data, num_workers=args.num_workers,
        eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        build_timeout_minutes=float(build_timeout_minutes) if build_timeout_minutes
        else DataConfig.build_timeout_minutes)
