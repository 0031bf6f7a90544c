"""Learning-rate and weight-decay schedule flags -> ``SchedulerConfig``, resolved to iterations."""
from __future__ import annotations

import argparse

from megatron.training.lr_scheduler import LR_DECAY_STYLES, WD_INCR_STYLES, SchedulerConfig


def add_scheduler_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations over which the learning rate decays (default: --train-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="iterations of linear warm-up (default 0; exclusive with --lr-warmup-fraction)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up length as a fraction of the decay iterations")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warm-up")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at iteration 0 (non-constant --weight-decay-incr-style)")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="weight decay at the last iteration (non-constant --weight-decay-incr-style)")
    g.add_argument("--weight-decay-incr-style", choices=WD_INCR_STYLES, default="constant")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, keep the command line's schedule settings instead of the checkpoint's")
    return parser


def scheduler_config_from_args(args: argparse.Namespace, train_iters: int) -> SchedulerConfig:
    """The schedule in iterations (reads --lr/--min-lr/--weight-decay of the optimizer flags too)."""
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise ValueError("--lr-warmup-iters and --lr-warmup-fraction are exclusive; pass only one of them")
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1) (got {args.lr_warmup_fraction})")
        warmup_iters = int(args.lr_warmup_fraction * decay_iters)
    else:
        warmup_iters = args.lr_warmup_iters or 0
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            raise ValueError("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
                             "cosine; with the constant style use --weight-decay")
        start_wd = end_wd = args.weight_decay
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            raise ValueError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both "
                             "--start-weight-decay and --end-weight-decay")
        start_wd, end_wd = args.start_weight_decay, args.end_weight_decay
    return SchedulerConfig(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_iters,
        lr_decay_steps=decay_iters, lr_decay_style=args.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=train_iters, wd_incr_style=args.weight_decay_incr_style,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
