"""Optimizer settings: AdamW, gradient clipping and fp16 loss scaling."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float  # peak learning rate; the scheduler writes the current one into the param groups
    min_lr: float = 0.0  # learning rate at the end of the decay
    weight_decay: float = 0.01  # AdamW decoupled weight decay, on parameters with >= 2 dimensions only
    adam_beta1: float = 0.9  # decay of the first-moment (gradient) average
    adam_beta2: float = 0.999  # decay of the second-moment (squared gradient) average
    adam_eps: float = 1e-8  # added to the second moment's square root
    clip_grad: float = 1.0  # max global L2 norm; 0 disables clipping (the norm is still computed and reported)
    fp16: bool = False  # fp16 parameters with fp32 master weights and loss scaling
    bf16: bool = False  # bf16 parameters with fp32 master weights
    loss_scale: float | None = None  # fp16 only: None = dynamic loss scaling, else this constant scale
    initial_loss_scale: float = 2.0 ** 32  # fp16: the first dynamic loss scale
    min_loss_scale: float = 1.0  # fp16: the dynamic loss scale never goes below this
    loss_scale_window: int = 1000  # fp16: overflow-free steps before the dynamic scale doubles
    hysteresis: int = 2  # fp16: overflows tolerated before the dynamic scale halves

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
