"""Checkpoint save/load flags -> ``CheckpointConfig``."""
from __future__ import annotations

import argparse

from megatron.training.checkpoint.config import CKPT_FORMATS, CheckpointConfig


def add_checkpoint_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="directory to save checkpoints to")
    g.add_argument("--load", type=str, default=None, help="directory to load the latest checkpoint from")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoint saves")
    g.add_argument("--no-save-optim", action="store_true", help="do not save optimizer and scheduler state")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer and scheduler state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; start at iteration 0 with fresh optimizer, scheduler and RNG")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
                   help="torch_dist: the distributed checkpoint, which any mesh and ZeRO placement loads; torch: the "
                        "per-rank legacy layout (same mesh only). Loading reads either")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training continues (torch_dist)")
    g.add_argument("--save-interval-minutes", type=float, default=None,
                   help="also save when this many minutes passed since the last save (preemptible clusters)")
    return parser


def checkpoint_config_from_args(args: argparse.Namespace) -> CheckpointConfig:
    return CheckpointConfig(save=args.save, load=args.load, save_interval=args.save_interval,
                            no_save_optim=args.no_save_optim, no_load_optim=args.no_load_optim,
                            no_load_rng=args.no_load_rng, finetune=args.finetune, ckpt_format=args.ckpt_format,
                            async_save=args.async_save, save_interval_minutes=args.save_interval_minutes)
