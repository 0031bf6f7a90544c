"""``--deepspeed`` flags (train through the zero_cache engine) -> ``DeepSpeedFlags``."""
from __future__ import annotations

import argparse

from megatron.training.config import DeepSpeedFlags


def add_deepspeed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("zero_cache (DeepSpeed-style)")
    g.add_argument("--deepspeed", action="store_true", help="train through the zero_cache engine")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=None,
                   help="overrides zero_optimization.stage of the config (no ZeRO: leave out --deepspeed)")
    return parser


def deepspeed_flags_from_args(args: argparse.Namespace) -> DeepSpeedFlags:
    return DeepSpeedFlags(enabled=args.deepspeed, config_path=args.deepspeed_config, zero_stage=args.zero_stage)
