"""fp16 loss scalers: a constant scale, or Megatron's dynamic scale with hysteresis."""
from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale (--loss-scale); overflowing steps are still skipped by the optimizer."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"loss scale must be > 0 (got {scale})")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Nothing adapts."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """The command line wins: a constant scale is configuration, not training state."""


class DynamicGradScaler:
    """Megatron's dynamic loss scale.

    An overflow resets the growth count and uses up one unit of hysteresis; once
    the hysteresis is spent, every further overflow multiplies the scale by
    ``backoff_factor`` (never below ``min_scale``). After ``growth_interval``
    overflow-free steps in a row the scale grows by ``growth_factor`` and the
    hysteresis is restored.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale ({min_scale}) <= initial_scale ({initial_scale})")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"need growth_factor > 1 (got {growth_factor}) and 0 < backoff_factor < 1 "
                             f"(got {backoff_factor})")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval ({growth_interval}) and hysteresis ({hysteresis}) must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
