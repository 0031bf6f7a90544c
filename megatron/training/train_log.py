"""Per-interval training log lines in Megatron's shape, and TensorBoard scalars.

Tools parse the ``key: value |`` fields, so names and order follow Megatron:
iteration, consumed samples, elapsed time per iteration (ms), learning rate,
global batch size, lm loss (7 significant digits), loss scale, grad norm, then
our throughput / memory / ETA fields. With the engine's communication profiling on,
a second line gives the last step's collectives against the ZeRO theory.
"""
from __future__ import annotations

import datetime
import math
import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil
import torch

if TYPE_CHECKING:
    from zero_cache.comm import CommStepStats


def memory_fields(device: torch.device, extra: dict[str, float] | None = None) -> str:
    """Process RSS now and at its peak so far, accelerator memory and any engine tiers, in GiB."""
    gib = 1024 ** 3
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the kernel's high-water mark (KiB)
    parts = [f"rss: {psutil.Process().memory_info().rss / gib:.2f}", f"peak rss: {peak / gib:.2f}"]
    if device.type == "cuda":
        parts.append(f"{device.type} max alloc: {torch.cuda.max_memory_allocated(device) / gib:.2f}")
    for name, nbytes in (extra or {}).items():
        parts.append(f"{name}: {nbytes / gib:.2f}")
    return "mem (GiB) " + ", ".join(parts)


@dataclass
class IntervalStats:
    """Accumulates losses and timing between two log lines."""
    start: float = field(default_factory=time.perf_counter)
    iters: int = 0
    skipped: int = 0
    nan: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0

    def add(self, loss: float | None, skipped: bool) -> None:
        self.iters += 1
        self.skipped += int(skipped)
        if loss is not None:
            if math.isfinite(loss):
                self.loss_sum += loss
                self.loss_count += 1
            else:
                self.nan += 1


class TrainLogger:
    def __init__(self, *, train_iters: int, global_batch_size: int, seq_length: int, flops_per_token: float,
                 world_size: int, device: torch.device, tensorboard_dir: str | None, is_logging_rank: bool):
        self.train_iters, self.gbs, self.seq = train_iters, global_batch_size, seq_length
        self.flops_per_token, self.world_size, self.device = flops_per_token, world_size, device
        self.is_logging_rank = is_logging_rank
        self.writer = None
        if tensorboard_dir and is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=tensorboard_dir)
        self.interval = IntervalStats()
        self.run_start = time.perf_counter()
        self.run_start_iteration: int | None = None

    def record(self, loss: float | None, skipped: bool) -> None:
        self.interval.add(loss, skipped)

    def log(self, iteration: int, consumed_samples: int, lr: float, loss_scale: float, grad_norm: float | None,
            extra_memory: dict[str, float] | None = None, comm: CommStepStats | None = None) -> str | None:
        """Emit the line for the interval ending at ``iteration``; returns it, and the comm line below it when
        ``comm`` (the last step's collectives) is given (on the logging rank)."""
        s, now = self.interval, time.perf_counter()
        if self.run_start_iteration is None:
            self.run_start_iteration = iteration - s.iters
        per_iter = (now - s.start) / max(s.iters, 1)
        tokens_per_s = self.gbs * self.seq / per_iter
        tflops = tokens_per_s * self.flops_per_token / self.world_size / 1e12
        done = iteration - self.run_start_iteration
        eta = (now - self.run_start) / max(done, 1) * (self.train_iters - iteration)
        loss = s.loss_sum / s.loss_count if s.loss_count else float("nan")
        fields = [
            f" iteration {iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {per_iter * 1000:.1f}",
            f"learning rate: {lr:.3E}",
            f"global batch size: {self.gbs:5d}",
            f"lm loss: {loss:.6E}",
            f"loss scale: {loss_scale:.1f}",
        ]
        if grad_norm is not None:
            fields.append(f"grad norm: {grad_norm:.3f}")
        fields += [
            f"number of skipped iterations: {s.skipped:3d}",
            f"number of nan iterations: {s.nan:3d}",
            f"tokens per second: {tokens_per_s:.1f}",
            f"TFLOPs: {tflops:.2f}",
            memory_fields(self.device, extra_memory),
            f"ETA: {datetime.timedelta(seconds=int(eta))}",
        ]
        line = " | ".join(fields) + " |"
        if comm is not None:
            line += "\n" + " | ".join([f" comm (step {iteration}, data-parallel group)", *comm.fields()]) + " |"
        if self.writer is not None:
            for tag, value in (("lm loss", loss), ("learning-rate", lr), ("loss-scale", loss_scale),
                               ("tokens-per-second", tokens_per_s), ("TFLOPs", tflops),
                               ("grad-norm", grad_norm)):
                if value is not None:
                    self.writer.add_scalar(tag, value, iteration)
            if comm is not None:
                self._write_comm(comm, iteration)
            self.writer.flush()
        self.interval = IntervalStats()
        if self.is_logging_rank:
            print(line, flush=True)
            return line
        return None

    def _write_comm(self, comm: CommStepStats, iteration: int) -> None:
        for kind, m in comm.measured.items():
            for name, value in (("count", m.count), ("bytes", m.nbytes), ("seconds", m.seconds),
                                ("wait_seconds", m.wait_seconds), ("theory_bytes", comm.theory[kind].nbytes),
                                ("bytes_vs_theory", comm.bytes_vs_theory(kind))):
                if value is not None:
                    self.writer.add_scalar(f"comm/{kind}_{name}", value, iteration)

    def log_eval(self, iteration: int, loss: float, split: str = "validation") -> None:
        if not self.is_logging_rank:
            return
        ppl = math.exp(min(20.0, loss))
        print("-" * 100 + f"\n {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
              f"lm loss PPL: {ppl:.6E} |\n" + "-" * 100, flush=True)
        if self.writer is not None:
            self.writer.add_scalar(f"lm loss {split}", loss, iteration)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
