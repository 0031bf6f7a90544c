"""Learning-rate and weight-decay schedule (Megatron-LM's OptimizerParamScheduler).

Learning rate: linear warm-up from ``init_lr`` to ``max_lr`` over
``lr_warmup_steps``; then ``constant`` (stay at max_lr), ``linear`` or ``cosine``
decay to ``min_lr`` at ``lr_decay_steps``; ``min_lr`` after that. Weight decay
goes from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (constant, linear
or cosine). A step is one optimizer iteration; ``step()`` is called once per
iteration and writes ``lr * lr_mult`` and ``wd * wd_mult`` into every param group.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class SchedulerConfig:
    """The schedule in optimizer steps (one per iteration). Field names are the keys of the scheduler's
    checkpoint state, as in Megatron-LM."""
    max_lr: float  # peak learning rate, reached at the end of warm-up
    min_lr: float  # learning rate at the end of the decay and after it
    lr_warmup_steps: int  # steps of linear warm-up from init_lr to max_lr (0: none)
    lr_decay_steps: int  # step at which the decay reaches min_lr
    lr_decay_style: str  # one of LR_DECAY_STYLES
    start_wd: float  # weight decay at step 0
    end_wd: float  # weight decay from wd_incr_steps on
    wd_incr_steps: int  # steps over which the weight decay goes from start_wd to end_wd
    init_lr: float = 0.0  # learning rate at the start of warm-up
    wd_incr_style: str = "constant"  # one of WD_INCR_STYLES
    override_opt_param_scheduler: bool = False  # on resume, keep these settings over the checkpoint's

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
            raise ValueError(f"--lr-decay-iters must be > 0 (got {self.lr_decay_steps})")
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise ValueError(f"warm-up steps ({self.lr_warmup_steps}) must be >= 0 and below the decay steps "
                             f"({self.lr_decay_steps}); shorten --lr-warmup-iters/--lr-warmup-fraction or raise "
                             "--lr-decay-iters")
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"need 0 <= --start-weight-decay ({self.start_wd}) <= --end-weight-decay "
                             f"({self.end_wd})")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"--weight-decay-incr-style constant needs equal start ({self.start_wd}) and end "
                             f"({self.end_wd}) weight decay; pick linear or cosine to change it during training")
        if self.wd_incr_steps <= 0:
            raise ValueError(f"weight-decay increment steps must be > 0 (got {self.wd_incr_steps})")


class OptimizerParamScheduler:
    """Follows ``config`` one optimizer step at a time; ``config`` is replaced by the checkpoint's on resume."""

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

    def state_dict(self) -> dict:
        state = {key: getattr(self.config, key) for key in self._SCHEDULE_KEYS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count. Schedule settings that differ from the checkpoint's are taken from the
        checkpoint with a warning, unless ``override_opt_param_scheduler`` keeps the command line's."""
        taken = {}
        for key in self._SCHEDULE_KEYS:
            ours = getattr(self.config, key)
            if key not in state or state[key] == ours:
                continue
            if self.config.override_opt_param_scheduler:
                logger.warning("scheduler %s: using the command line's %r over the checkpoint's %r "
                               "(--override-opt_param-scheduler)", key, ours, state[key])
            else:
                logger.warning("scheduler %s: the checkpoint's %r differs from the command line's %r; using the "
                               "checkpoint's (pass --override-opt_param-scheduler to keep the command line's)",
                               key, state[key], ours)
                taken[key] = state[key]
        self.config = dataclasses.replace(self.config, **taken)
        self.num_steps = int(state["num_steps"])
        self.step(0)
