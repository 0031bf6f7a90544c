"""How the trainer saves and loads checkpoints, built once from the command line."""
from __future__ import annotations

from dataclasses import dataclass

CKPT_FORMATS = ("torch_dist", "torch")


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None  # directory to save checkpoints to (None: no saving)
    load: str | None  # directory to load the latest checkpoint from (None: start from scratch)
    save_interval: int | None  # iterations between saves (None: save at the end of training only)
    no_save_optim: bool = False  # leave optimizer and scheduler state out of saved checkpoints
    no_load_optim: bool = False  # do not restore optimizer and scheduler state
    no_load_rng: bool = False  # do not restore the RNG states
    finetune: bool = False  # restore the weights only and start at iteration 0
    # torch_dist: the distributed checkpoint (any mesh and ZeRO placement loads it); torch: the per-rank
    # legacy layouts (Megatron's mp_rank files, or the engine's zero_pp_rank files under --deepspeed), which
    # load only into the mesh that wrote them. Loading reads either, whatever this says.
    ckpt_format: str = "torch_dist"
    async_save: bool = False  # torch_dist: write in the background; the next optimizer step waits for it
    save_interval_minutes: float | None = None  # also save when this much wall-clock time passed since the last

    def __post_init__(self):
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1 (got {self.save_interval})")
        if self.ckpt_format not in CKPT_FORMATS:
            raise ValueError(f"--ckpt-format {self.ckpt_format!r}: choose one of {', '.join(CKPT_FORMATS)}")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ValueError("--async-save needs --ckpt-format torch_dist (the legacy layouts save synchronously)")
        if self.save_interval_minutes is not None and self.save_interval_minutes <= 0:
            raise ValueError(f"--save-interval-minutes must be > 0 (got {self.save_interval_minutes})")
        if (self.async_save or self.save_interval_minutes) and not self.save:
            raise ValueError("--async-save / --save-interval-minutes need --save DIR")
