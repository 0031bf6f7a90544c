"""Optimizer and loss-scaling flags -> ``OptimizerConfig`` (--fp16/--bf16 live in the model's precision group)."""
from __future__ import annotations

import argparse

from megatron.core.optimizer.config import OptimizerConfig


def add_optimizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="adam",
                   help="adam: AdamW with decoupled weight decay, as Megatron's adam is (sgd and the others are not "
                        "implemented here)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (after warm-up)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW decoupled weight decay, applied to parameters with >= 2 dimensions only")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient L2 norm; 0 disables")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: constant loss scale; omit for dynamic loss scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="fp16: first dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: dynamic loss scale floor")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: overflow-free steps before the dynamic loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="fp16: overflows tolerated before the dynamic loss scale halves")
    return parser


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    """Reads --fp16/--bf16 of the precision group too."""
    if args.lr is None:
        raise ValueError("--lr is required (the peak learning rate, e.g. --lr 3e-4)")
    if args.optimizer != "adam":
        raise ValueError(f"--optimizer {args.optimizer}: only adam (AdamW) is implemented here; drop the flag or use "
                         "--optimizer adam")
    return OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, fp16=args.fp16,
        bf16=args.bf16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)
