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
    # Snapshots in host memory (snapshots.py): every N iterations into <dir>/<host>/, with --replication also
    # into a rank's directory on another host (--replication-jump ranks on; None: the next host's).
    non_persistent_save_interval: int | None = None
    non_persistent_ckpt_type: str | None = None  # "local": the only kind here
    non_persistent_local_ckpt_dir: str | None = None
    replication: bool = False
    replication_jump: int | None = None
    replication_factor: int = 2  # copies of each file, the host's own included

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
        self._check_snapshots()

    @property
    def snapshots(self) -> bool:
        return self.non_persistent_ckpt_type == "local"

    def _check_snapshots(self) -> None:
        kind = self.non_persistent_ckpt_type
        if kind not in (None, "local"):
            raise ValueError(f"--non-persistent-ckpt-type {kind}: only 'local' is built here (snapshots in each "
                             f"host's memory, copied to a peer with --replication); use it, or --save for global")
        given = [flag for flag, value in (("--non-persistent-save-interval", self.non_persistent_save_interval),
                                          ("--non-persistent-local-ckpt-dir", self.non_persistent_local_ckpt_dir))
                 if value is None]
        if kind is None:
            if len(given) < 2 or self.replication:
                raise ValueError("--non-persistent-save-interval / --non-persistent-local-ckpt-dir / --replication "
                                 "need --non-persistent-ckpt-type local")
            return
        if given:
            raise ValueError(f"--non-persistent-ckpt-type local needs {' and '.join(given)} (for example "
                             f"--non-persistent-save-interval 10 --non-persistent-local-ckpt-dir /dev/shm/ptm)")
        if self.non_persistent_save_interval < 1:
            raise ValueError(f"--non-persistent-save-interval must be >= 1 (got {self.non_persistent_save_interval})")
        if not self.save:
            raise ValueError("--non-persistent-ckpt-type local needs --save DIR: snapshots stand in for its "
                             "checkpoints between saves and are removed once the last one is written")
        if self.replication_factor != 2:
            raise ValueError(f"--replication-factor {self.replication_factor}: 2 is supported here (each file on "
                             f"its host and on one other host)")
        if self.replication_jump is not None and self.replication_jump < 1:
            raise ValueError(f"--replication-jump must be >= 1 (got {self.replication_jump})")
