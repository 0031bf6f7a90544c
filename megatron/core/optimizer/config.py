"""Optimizer settings (Adam, clipping, loss scaling), built once from the command line."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still computed and reported)
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # fp16 only: None = dynamic loss scaling, else this constant scale
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0 (got {self.lr})")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be in [0, --lr ({self.lr})]")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0 (got {self.weight_decay})")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1) (got {getattr(self, name)})")
        if self.adam_eps <= 0:
            raise ValueError(f"--adam-eps must be > 0 (got {self.adam_eps})")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping; got {self.clip_grad})")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"--loss-scale must be > 0 (got {self.loss_scale}); omit it for dynamic scaling")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ValueError(f"need 0 < --min-loss-scale ({self.min_loss_scale}) <= --initial-loss-scale "
                             f"({self.initial_loss_scale})")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(f"--loss-scale-window ({self.loss_scale_window}) and --hysteresis ({self.hysteresis}) "
                             "must be >= 1")


def add_optimizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's optimizer and loss-scaling flags (--fp16/--bf16 live in the precision group)."""
    g = parser.add_argument_group("optimizer")
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
    if args.lr is None:
        raise ValueError("--lr is required (the peak learning rate, e.g. --lr 3e-4)")
    return OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        fp16=bool(getattr(args, "fp16", False)), bf16=bool(getattr(args, "bf16", False)),
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)
