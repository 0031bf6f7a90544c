"""Learning-rate and weight-decay schedule (Megatron-LM's OptimizerParamScheduler).

Learning rate: linear warm-up from ``init_lr`` to ``max_lr`` over
``lr_warmup_steps``; then ``constant`` (stay at max_lr), ``linear`` or ``cosine``
decay to ``min_lr`` at ``lr_decay_steps``; ``min_lr`` after that. Weight decay
goes from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (constant, linear
or cosine). A step is one optimizer iteration; ``step()`` is called once per
iteration and writes ``lr * lr_mult`` and ``wd * wd_mult`` into every param group.
"""
from __future__ import annotations

import argparse
import logging
import math

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    def __init__(self, optimizer, *, init_lr: float = 0.0, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float, wd_incr_steps: int,
                 wd_incr_style: str = "constant", override_opt_param_scheduler: bool = False):
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"unknown --lr-decay-style {lr_decay_style!r}; choose one of {LR_DECAY_STYLES}")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"unknown --weight-decay-incr-style {wd_incr_style!r}; choose one of {WD_INCR_STYLES}")
        if not 0.0 <= min_lr <= max_lr or init_lr < 0:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr}) and --lr-warmup-init ({init_lr}) >= 0")
        if lr_decay_steps <= 0:
            raise ValueError(f"--lr-decay-iters must be > 0 (got {lr_decay_steps})")
        if not 0 <= lr_warmup_steps < lr_decay_steps:
            raise ValueError(f"warm-up steps ({lr_warmup_steps}) must be >= 0 and below the decay steps "
                             f"({lr_decay_steps}); shorten --lr-warmup-iters/--lr-warmup-fraction or raise "
                             "--lr-decay-iters")
        if not 0.0 <= start_wd <= end_wd:
            raise ValueError(f"need 0 <= --start-weight-decay ({start_wd}) <= --end-weight-decay ({end_wd})")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(f"--weight-decay-incr-style constant needs equal start ({start_wd}) and end ({end_wd}) "
                             "weight decay; pick linear or cosine to change it during training")
        if wd_incr_steps <= 0:
            raise ValueError(f"weight-decay increment steps must be > 0 (got {wd_incr_steps})")
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = float(init_lr), float(max_lr), float(min_lr)
        self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style = lr_warmup_steps, lr_decay_steps, lr_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        """Learning rate at ``num_steps`` (Megatron's formula)."""
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.lr_decay_steps:
            return self.min_lr
        decay_ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_wd(self) -> float:
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        incr_ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1.0 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        if self.optimizer is None:  # the caller passes get_lr() to its optimizer itself (zero_cache engine)
            return
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    # ----- checkpointing -----
    _SCHEDULE_KEYS = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                      "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")

    def state_dict(self) -> dict:
        state = {key: getattr(self, key) for key in self._SCHEDULE_KEYS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count. Schedule settings that differ from the checkpoint's are taken from the
        checkpoint with a warning, unless ``override_opt_param_scheduler`` keeps the command line's."""
        for key in self._SCHEDULE_KEYS:
            if key not in state or state[key] == getattr(self, key):
                continue
            if self.override_opt_param_scheduler:
                logger.warning("scheduler %s: using the command line's %r over the checkpoint's %r "
                               "(--override-opt_param-scheduler)", key, getattr(self, key), state[key])
            else:
                logger.warning("scheduler %s: the checkpoint's %r differs from the command line's %r; using the "
                               "checkpoint's (pass --override-opt_param-scheduler to keep the command line's)",
                               key, state[key], getattr(self, key))
                setattr(self, key, state[key])
        self.num_steps = int(state["num_steps"])
        self.step(0)


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


def scheduler_from_args(args: argparse.Namespace, optimizer, train_iters: int) -> OptimizerParamScheduler:
    """Build the schedule in iterations (reads --lr/--min-lr/--weight-decay of the optimizer flags too)."""
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
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_iters,
        lr_decay_steps=decay_iters, lr_decay_style=args.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=train_iters, wd_incr_style=args.weight_decay_incr_style,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
