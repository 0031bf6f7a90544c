"""Loss scaling for fp16: static, or dynamic with DeepSpeed's window/hysteresis rules.

Dynamic: on an overflow step the update is skipped; once ``hysteresis`` overflows have been absorbed the
scale is halved (never below ``min_loss_scale``). After ``loss_scale_window`` clean steps in a row the
scale doubles. bf16 and fp32 use a constant scale of 1.
"""
from __future__ import annotations

from .config import FP16Config


class LossScaler:
    def __init__(self, cfg: FP16Config):
        self.dynamic = cfg.enabled and cfg.loss_scale == 0
        self.scale = float(2 ** cfg.initial_scale_power) if self.dynamic else (
            cfg.loss_scale if cfg.enabled else 1.0)
        self.window = cfg.loss_scale_window
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.min_scale = cfg.min_loss_scale
        self.hysteresis_left = cfg.hysteresis
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.hysteresis_left = int(sd["hysteresis_left"])
        self.clean_steps = int(sd["clean_steps"])

    # Checkpoints store a dynamic scaler in Megatron's terms, so either trainer backend resumes it:
    # growth_tracker = clean steps since the last growth, hysteresis_tracker = overflows left before a halving.
    def common_state(self) -> dict | None:
        """None unless the scale is dynamic."""
        if not self.dynamic:
            return None
        return {"scale": self.scale, "growth_tracker": self.clean_steps % self.window,
                "hysteresis_tracker": self.hysteresis_left}

    def load_common_state(self, state: dict | None) -> None:
        if not self.dynamic or state is None:
            return
        self.scale = float(state["scale"])
        self.clean_steps = int(state["growth_tracker"])
        self.hysteresis_left = max(1, int(state["hysteresis_tracker"]))
