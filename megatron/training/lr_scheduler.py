"""Learning-rate and weight-decay schedule (Megatron-LM's OptimizerParamScheduler).

Learning rate: linear warm-up from ``init_lr`` to ``max_lr`` over
``lr_warmup_steps``; then ``constant`` (stay at max_lr), ``linear`` or ``cosine``
decay to ``min_lr`` at ``lr_decay_steps``; ``min_lr`` after that. Weight decay
goes from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (constant, linear
or cosine). As in Megatron, a step is one sample: ``step(n)`` is called after each
successful optimizer update with the iteration's global batch size, so the schedule
follows the samples seen also while the batch size ramps up; it writes
``lr * lr_mult`` and ``wd * wd_mult`` into every param group.

On resume a schedule that differs from the checkpoint's is an error unless
``--override-opt_param-scheduler`` (the flags win) or
``--use-checkpoint-opt_param-scheduler`` (the checkpoint wins) says which one to
follow: silently following the checkpoint's trains a longer run at ``min_lr``. Settings that neither
schedule reads do not count: a constant learning rate has no decay length or ``min_lr``, so a constant-LR run
resumes with a larger ``--train-iters`` / ``--train-samples`` as it is.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class SchedulerMismatchError(ValueError):
    """The flags' schedule differs from the checkpoint's and no flag says which wins: one line, exit code 2."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The schedule in steps of one sample, as in Megatron-LM. Field names are the keys of the scheduler's
    checkpoint state, as in Megatron-LM."""
    max_lr: float  # peak learning rate, reached at the end of warm-up
    min_lr: float  # learning rate at the end of the decay and after it
    lr_warmup_steps: float  # samples of linear warm-up from init_lr to max_lr (0: none; a fraction may be fractional)
    lr_decay_steps: int  # sample at which the decay reaches min_lr
    lr_decay_style: str  # one of LR_DECAY_STYLES
    start_wd: float  # weight decay at step 0
    end_wd: float  # weight decay from wd_incr_steps on
    wd_incr_steps: int  # samples over which the weight decay goes from start_wd to end_wd
    init_lr: float = 0.0  # learning rate at the start of warm-up
    wd_incr_style: str = "constant"  # one of WD_INCR_STYLES
    override_opt_param_scheduler: bool = False  # on resume, the flags' schedule wins over a different checkpoint's
    use_checkpoint_opt_param_scheduler: bool = False  # on resume, the checkpoint's schedule wins over the flags'

    def __post_init__(self):
        for name in ("max_lr", "min_lr", "init_lr", "start_wd", "end_wd"):
            object.__setattr__(self, name, float(getattr(self, name)))  # checkpoints hold plain floats
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"unknown --lr-decay-style {self.lr_decay_style!r}; choose one of {LR_DECAY_STYLES}")
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"unknown --weight-decay-incr-style {self.wd_incr_style!r}; "
                             f"choose one of {WD_INCR_STYLES}")
        if not 0.0 <= self.min_lr <= self.max_lr or self.init_lr < 0:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.max_lr}) and --lr-warmup-init "
                             f"({self.init_lr}) >= 0")
        if self.lr_decay_steps <= 0:
            raise ValueError(f"the learning-rate decay length must be > 0 samples (got {self.lr_decay_steps}); raise "
                             "--lr-decay-iters/-samples/-tokens")
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise ValueError(f"warm-up samples ({self.lr_warmup_steps:g}) must be >= 0 and below the decay samples "
                             f"({self.lr_decay_steps}); shorten --lr-warmup-iters/-fraction/-samples/-tokens or raise "
                             "--lr-decay-iters/-samples/-tokens")
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"need 0 <= --start-weight-decay ({self.start_wd}) <= --end-weight-decay "
                             f"({self.end_wd})")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"--weight-decay-incr-style constant needs equal start ({self.start_wd}) and end "
                             f"({self.end_wd}) weight decay; pick linear or cosine to change it during training")
        if self.wd_incr_steps <= 0:
            raise ValueError(f"weight-decay increment steps must be > 0 (got {self.wd_incr_steps})")


def _shown(*values) -> list[str]:
    """Floats to 6 significant digits (a warm-up fraction's 2.4000000000000004 is 2.4), unless that hides the
    difference."""
    short = [f"{v:g}" if isinstance(v, float) else repr(v) for v in values]
    return short if len(set(short)) == len(short) else [repr(v) for v in values]


class OptimizerParamScheduler:
    """Follows ``config`` one sample at a time; on resume ``config`` may become the checkpoint's."""

    def __init__(self, optimizer, config: SchedulerConfig):
        self.optimizer = optimizer
        self.config = config
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        """Learning rate at ``num_steps`` (Megatron's formula)."""
        c = self.config
        if c.lr_warmup_steps > 0 and self.num_steps <= c.lr_warmup_steps:
            return c.init_lr + (c.max_lr - c.init_lr) * self.num_steps / c.lr_warmup_steps
        if c.lr_decay_style == "constant":
            return c.max_lr
        if self.num_steps > c.lr_decay_steps:
            return c.min_lr
        decay_ratio = (self.num_steps - c.lr_warmup_steps) / (c.lr_decay_steps - c.lr_warmup_steps)
        if c.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return c.min_lr + coeff * (c.max_lr - c.min_lr)

    def get_wd(self) -> float:
        c = self.config
        if self.num_steps > c.wd_incr_steps or c.wd_incr_style == "constant":
            return c.end_wd
        incr_ratio = self.num_steps / c.wd_incr_steps
        if c.wd_incr_style == "linear":
            coeff = incr_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1.0 - incr_ratio)) + 1.0)
        return c.start_wd + coeff * (c.end_wd - c.start_wd)

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
    # What a differing key means and which flags set it, for the mismatch error.
    _FLAGS = {"init_lr": "--lr-warmup-init", "max_lr": "--lr", "min_lr": "--min-lr",
              "lr_warmup_steps": "warm-up samples, --lr-warmup-iters/-fraction/-samples/-tokens",
              "lr_decay_steps": "decay samples, --lr-decay-iters/-samples/-tokens or the training length",
              "lr_decay_style": "--lr-decay-style", "start_wd": "--start-weight-decay or --weight-decay",
              "end_wd": "--end-weight-decay or --weight-decay",
              "wd_incr_steps": "weight-decay increment samples, the training length",
              "wd_incr_style": "--weight-decay-incr-style"}

    def state_dict(self) -> dict:
        state = {key: getattr(self.config, key) for key in self._SCHEDULE_KEYS}
        state["num_steps"] = self.num_steps
        return state

    @staticmethod
    def _unread(settings: Callable[[str], Any]) -> set[str]:
        """The keys the schedule of ``settings`` (a config's or a checkpoint's, by key) never reads, so that a
        resume that changes only them gives the same values at every step, past and future."""
        unread = set()
        if settings("lr_warmup_steps") == 0:
            unread.add("init_lr")
        if settings("lr_decay_style") == "constant":  # max_lr from the end of warm-up on, however long the run
            unread |= {"lr_decay_steps", "min_lr"}
        if settings("wd_incr_style") == "constant":  # end_wd (== start_wd) at every step
            unread.add("wd_incr_steps")
        return unread

    def _differences(self, state: dict) -> dict[str, tuple]:
        """Key -> (checkpoint's, flags') for every setting that differs and that either schedule reads."""
        c = self.config
        diffs = {key: (state[key], getattr(c, key)) for key in self._SCHEDULE_KEYS
                 if key in state and state[key] != getattr(c, key)}
        unread = self._unread(lambda key: getattr(c, key)) & self._unread(lambda key: state.get(key, getattr(c, key)))
        return {key: values for key, values in diffs.items() if key not in unread}

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count; see the module's docstring for a schedule that differs from the checkpoint's."""
        diffs = self._differences(state)
        if diffs and self.config.use_checkpoint_opt_param_scheduler:
            self.config = dataclasses.replace(self.config, **{key: ckpt for key, (ckpt, _) in diffs.items()})
            logger.info("learning-rate schedule: the checkpoint's %s (--use-checkpoint-opt_param-scheduler)",
                        ", ".join(f"{key} {ckpt!r}" for key, (ckpt, _) in diffs.items()))
        elif diffs and self.config.override_opt_param_scheduler:
            logger.info("learning-rate schedule: the flags' %s (--override-opt_param-scheduler)",
                        ", ".join(f"{key} {ours!r}" for key, (_, ours) in diffs.items()))
        elif diffs:
            listed = "; ".join(f"{key} {' in the checkpoint, '.join(_shown(ckpt, ours))} from the flags "
                               f"({self._FLAGS[key]})" for key, (ckpt, ours) in diffs.items())
            raise SchedulerMismatchError(
                f"the learning-rate schedule differs from the checkpoint's: {listed}; pass "
                "--override-opt_param-scheduler to train with the flags' schedule or "
                "--use-checkpoint-opt_param-scheduler to continue the checkpoint's")
        self.num_steps = int(state["num_steps"])
        self.step(0)
