"""``--deepspeed`` flags (train through the zero_cache engine) and ``--use-distributed-optimizer`` ->
``DeepSpeedFlags``."""
from __future__ import annotations

import argparse

from megatron.training.config import DeepSpeedFlags


def add_deepspeed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("zero_cache (DeepSpeed-style)")
    g.add_argument("--deepspeed", action="store_true", help="train through the zero_cache engine")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                   help="the DeepSpeed-style JSON (with --deepspeed)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="overrides zero_optimization.stage of the config; 0: no ZeRO, Megatron DDP")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer states and fp32 gradients over the data-parallel group: ZeRO-1 "
                        "through the zero_cache engine (with --deepspeed: its JSON's stage, 1 or more)")
    return parser


def deepspeed_flags_from_args(args: argparse.Namespace) -> DeepSpeedFlags:
    return DeepSpeedFlags(enabled=args.deepspeed, config_path=args.deepspeed_config, zero_stage=args.zero_stage,
                          distributed_optimizer=args.use_distributed_optimizer)
