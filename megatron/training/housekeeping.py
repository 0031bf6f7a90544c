"""Per-step housekeeping of Megatron-LM's loop: manual garbage collection (``--manual-gc``), returning cached CUDA
memory (``--empty-unused-memory-level``) and the CUDA profiler range (``--profile``).

Python's collector pauses a rank whenever its allocation count says so, at a different moment on each rank, and
every collective waits for the slowest: with ``--manual-gc`` all ranks collect at the same iterations instead.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HousekeepingConfig:
    manual_gc: bool = False  # automatic collection off; collect at the points below instead
    manual_gc_interval: int = 0  # collect every this many iterations (0: only around evaluations)
    manual_gc_eval: bool = True  # collect before and after each evaluation
    empty_unused_memory_level: int = 0  # 1: empty the CUDA cache after each step; 2: after evaluations too
    profile: bool = False  # cudaProfilerStart/Stop around iterations [profile_step_start, profile_step_end)
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)

    def __post_init__(self):
        if self.manual_gc_interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0 (got {self.manual_gc_interval})")
        if self.profile and not 0 <= self.profile_step_start < self.profile_step_end:
            raise ValueError(f"--profile needs 0 <= --profile-step-start ({self.profile_step_start}) < "
                             f"--profile-step-end ({self.profile_step_end})")


class Housekeeping:
    def __init__(self, cfg: HousekeepingConfig, device: torch.device, rank: int):
        self.cfg, self.device = cfg, device
        self.profiling = cfg.profile and device.type == "cuda" and rank in cfg.profile_ranks
        self._gc_was_enabled = gc.isenabled()
        if cfg.manual_gc:
            gc.disable()
            gc.collect()

    def before_step(self, iteration: int) -> None:
        """``iteration``: the number of the step about to run, counted from 0 as Megatron's profile flags are."""
        if self.profiling and iteration == self.cfg.profile_step_start:
            torch.cuda.cudart().cudaProfilerStart()
            torch.autograd.profiler.emit_nvtx(record_shapes=True).__enter__()

    def after_step(self, iteration: int) -> None:
        """``iteration``: the number of steps done."""
        if self.profiling and iteration == self.cfg.profile_step_end:
            torch.cuda.cudart().cudaProfilerStop()
        if self.cfg.empty_unused_memory_level >= 1 and self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.cfg.manual_gc and self.cfg.manual_gc_interval and iteration % self.cfg.manual_gc_interval == 0:
            gc.collect()

    def around_eval(self) -> None:
        """Before and after an evaluation."""
        if self.cfg.manual_gc and self.cfg.manual_gc_eval:
            gc.collect()
        if self.cfg.empty_unused_memory_level >= 2 and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.cfg.manual_gc and self._gc_was_enabled:
            gc.enable()
