"""Learning-rate and weight-decay schedule flags -> ``SchedulerConfig``, resolved to samples (as Megatron does).

Each length can be given in iterations (x the global batch size), samples, or, as Megatron-DeepSpeed does,
tokens (/ --seq-length, rounded down): one unit per length.
"""
from __future__ import annotations

import argparse

from megatron.training.lr_scheduler import LR_DECAY_STYLES, WD_INCR_STYLES, SchedulerConfig


def add_scheduler_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations over which the learning rate decays (default: the training length)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="the decay length in samples")
    g.add_argument("--lr-decay-tokens", type=int, default=None, help="the decay length in tokens")
    g.add_argument("--lr-warmup-iters", type=int, default=None, help="iterations of linear warm-up (default: none)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up length as a fraction of the decay length")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="the warm-up length in samples")
    g.add_argument("--lr-warmup-tokens", type=int, default=None, help="the warm-up length in tokens")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warm-up")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at iteration 0 (non-constant --weight-decay-incr-style)")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="weight decay at the last iteration (non-constant --weight-decay-incr-style)")
    g.add_argument("--weight-decay-incr-style", choices=WD_INCR_STYLES, default="constant")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, a schedule that differs from the checkpoint's is the flags' (the flags win)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, a schedule that differs from the checkpoint's is the checkpoint's (it wins)")
    return parser


def _length(args: argparse.Namespace, kind: str, global_batch_size: int, seq_length: int) -> float | None:
    """``--lr-<kind>-iters/-samples/-tokens`` (and -fraction for warm-up) in samples; None when none is given."""
    given = {unit: getattr(args, f"lr_{kind}_{unit}", None) for unit in ("iters", "samples", "tokens", "fraction")}
    given = {unit: value for unit, value in given.items() if value is not None}
    if len(given) > 1:
        flags = " and ".join(f"--lr-{kind}-{unit}" for unit in given)
        raise ValueError(f"{flags} are exclusive (each gives the {kind} length); pass one of them")
    if "iters" in given:
        return given["iters"] * global_batch_size
    if "tokens" in given:
        return given["tokens"] // seq_length
    return given.get("samples")


def scheduler_config_from_args(args: argparse.Namespace, train_samples: int, global_batch_size: int,
                               seq_length: int) -> SchedulerConfig:
    """The schedule in samples (reads --lr/--min-lr/--weight-decay of the optimizer flags too). ``train_samples``:
    the training length in samples, the default decay and weight-decay increment length."""
    decay = _length(args, "decay", global_batch_size, seq_length)
    decay = train_samples if decay is None else decay
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1) (got {args.lr_warmup_fraction})")
        warmup = args.lr_warmup_fraction * decay
        _length(args, "warmup", global_batch_size, seq_length)  # only to refuse a second warm-up length
    else:
        warmup = _length(args, "warmup", global_batch_size, seq_length) or 0
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
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler (the flags' schedule wins) and "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's wins) contradict; pass one")
    return SchedulerConfig(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=train_samples, wd_incr_style=args.weight_decay_incr_style,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler)
