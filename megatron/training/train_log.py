"""Per-interval training log lines in Megatron's shape, and the same scalars for TensorBoard and W&B.

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
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
import torch

from megatron.training.scalar_writers import ScalarWriter, TensorBoardWriter, WandbWriter

if TYPE_CHECKING:
    from megatron.training.run_log import RunLog
    from zero_cache.comm import CommStepStats

GIB = 1024 ** 3


@dataclass(frozen=True)
class LogConfig:
    """What the logging rank writes besides the log line (TensorBoard's directory is TrainConfig's)."""
    tensorboard_queue_size: int = 1000  # TensorBoard events held before they are written
    log_timers: bool = False  # also the scalar iteration-time (seconds per iteration)
    log_batch_size: bool = False  # also the scalar batch-size (the global batch size)
    log_validation_ppl: bool = False  # also the validation perplexity
    wandb_project: str | None = None  # log the scalars to this W&B project too (None: no W&B)
    wandb_exp_name: str | None = None  # the W&B run's name
    wandb_save_dir: str | None = None  # where W&B keeps the run (None: W&B's default, ./wandb)
    wandb_entity: str | None = None  # the W&B team or user (None: W&B's default)
    log_file: str | None = None  # the logging rank's log lines also go to this text file (run_log.py; None: none)

    def __post_init__(self):
        if self.tensorboard_queue_size < 1:
            raise ValueError(f"--tensorboard-queue-size must be >= 1 (got {self.tensorboard_queue_size})")


def memory_gib(device: torch.device, extra: dict[str, float] | None = None) -> dict[str, float]:
    """Process RSS now and at its peak so far, accelerator memory and any engine tiers (bytes), in GiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the kernel's high-water mark (KiB)
    out = {"rss": psutil.Process().memory_info().rss / GIB, "peak rss": peak / GIB}
    if device.type == "cuda":
        out[f"{device.type} max alloc"] = torch.cuda.max_memory_allocated(device) / GIB
    for name, nbytes in (extra or {}).items():
        out[name] = nbytes / GIB
    return out


def memory_fields(memory: dict[str, float]) -> str:
    return "mem (GiB) " + ", ".join(f"{name}: {gib:.2f}" for name, gib in memory.items())


@dataclass
class IntervalStats:
    """Accumulates losses and timing between two log lines."""
    start: float = field(default_factory=time.perf_counter)
    iters: int = 0
    skipped: int = 0
    nan: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    samples: int = 0
    last_batch: int = 0  # the global batch size of the interval's last iteration

    def add(self, loss: float | None, skipped: bool, samples: int) -> None:
        self.iters += 1
        self.samples += samples
        self.last_batch = samples
        self.skipped += int(skipped)
        if loss is not None:
            if math.isfinite(loss):
                self.loss_sum += loss
                self.loss_count += 1
            else:
                self.nan += 1


class TrainLogger:
    def __init__(self, *, train_iters: int, global_batch_size: int, seq_length: int, flops_per_token: float,
                 world_size: int, device: torch.device, tensorboard_dir: str | None, is_logging_rank: bool,
                 log: LogConfig = LogConfig(), run_config: dict[str, Any] | None = None,
                 run_log: RunLog | None = None):
        """``global_batch_size``: an iteration's samples unless ``record`` says otherwise; ``run_config``: the
        run's flags, stored with the W&B run; ``run_log``: where the logging rank's lines go (None: stdout)."""
        self.train_iters, self.gbs, self.seq = train_iters, global_batch_size, seq_length
        self.flops_per_token, self.world_size, self.device = flops_per_token, world_size, device
        self.is_logging_rank, self.cfg = is_logging_rank, log
        self.writers: list[ScalarWriter] = []
        if is_logging_rank and tensorboard_dir:
            self.writers.append(TensorBoardWriter(tensorboard_dir, log.tensorboard_queue_size))
        if is_logging_rank and log.wandb_project:
            self.writers.append(WandbWriter(log.wandb_project, log.wandb_exp_name, log.wandb_save_dir,
                                            log.wandb_entity, run_config or {}))
        self.run_log = run_log
        self.interval = IntervalStats()
        self.run_start = time.perf_counter()
        self.run_start_iteration: int | None = None
        self.last_finite_loss: float | None = None  # for the run's summary line
        self.interval_tokens_per_s: list[float] = []  # of every logged interval, for the summary line

    def record(self, loss: float | None, skipped: bool, samples: int | None = None) -> None:
        """One iteration: its loss, whether its update was skipped, its global batch (default: the constant one)."""
        self.interval.add(loss, skipped, self.gbs if samples is None else samples)
        if loss is not None and math.isfinite(loss):
            self.last_finite_loss = loss

    def log(self, iteration: int, consumed_samples: int, lr: float, loss_scale: float, grad_norm: float | None,
            extra_memory: dict[str, float] | None = None, comm: CommStepStats | None = None,
            moe: dict[str, float] | None = None, offload: dict[str, int] | None = None) -> str | None:
        """Emit the line for the interval ending at ``iteration``; returns it, and the comm line below it when
        ``comm`` (the last step's collectives) is given (on the logging rank). ``offload``: the last step's
        activation offload (--cpu-offloading; zero_cache's ActivationOffloadStats as a dict)."""
        s, now = self.interval, time.perf_counter()
        if self.run_start_iteration is None:
            self.run_start_iteration = iteration - s.iters
        per_iter = (now - s.start) / max(s.iters, 1)
        tokens_per_s = s.samples * self.seq / max(now - s.start, 1e-9)
        self.interval_tokens_per_s.append(tokens_per_s)
        tflops = tokens_per_s * self.flops_per_token / self.world_size / 1e12
        done = iteration - self.run_start_iteration
        eta = (now - self.run_start) / max(done, 1) * (self.train_iters - iteration)
        loss = s.loss_sum / s.loss_count if s.loss_count else float("nan")
        memory = memory_gib(self.device, extra_memory)
        fields = [
            f" iteration {iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {per_iter * 1000:.1f}",
            f"learning rate: {lr:.3E}",
            f"global batch size: {s.last_batch or self.gbs:5d}",
            f"lm loss: {loss:.6E}",
            f"loss scale: {loss_scale:.1f}",
        ]
        if grad_norm is not None:
            fields.append(f"grad norm: {grad_norm:.3f}")
        moe = moe or {}  # MoE routers: the interval's mean auxiliary losses and per-layer load imbalance
        fields += [f"{key.replace('_', ' ')}: {value:.4E}" for key, value in moe.items() if key.endswith("loss")]
        if "max_load_imbalance" in moe:
            fields.append(f"expert load max/mean: {moe['min_load_imbalance']:.2f}-{moe['max_load_imbalance']:.2f}")
        fields += [
            f"number of skipped iterations: {s.skipped:3d}",
            f"number of nan iterations: {s.nan:3d}",
            f"tokens per second: {tokens_per_s:.1f}",
            f"TFLOPs: {tflops:.2f}",
            memory_fields(memory),
        ]
        if offload is not None:
            fields.append(f"activations to host (MiB): {offload['offloaded_bytes'] / 2**20:.1f} (peak "
                          f"{offload['host_peak_bytes'] / 2**20:.1f}, {offload['demand_reloads']} not prefetched)")
        fields.append(f"ETA: {datetime.timedelta(seconds=int(eta))}")
        line = " | ".join(fields) + " |"
        if comm is not None:
            line += "\n" + " | ".join([f" comm (step {iteration}, data-parallel group)", *comm.fields()]) + " |"
        if self.writers:
            scalars = {"lm loss": loss, "learning-rate": lr, "loss-scale": loss_scale,
                       "tokens-per-second": tokens_per_s, "TFLOPs": tflops, "grad-norm": grad_norm,
                       **{f"moe/{key}": value for key, value in moe.items()},
                       **{f"memory/{name} GiB": gib for name, gib in memory.items()},
                       **{f"activation-offload/{key}": value for key, value in (offload or {}).items()}}
            if self.cfg.log_timers:
                scalars["iteration-time"] = per_iter
            if self.cfg.log_batch_size:
                scalars["batch-size"] = s.last_batch or self.gbs
            if comm is not None:
                scalars.update(self._comm_scalars(comm))
            self._write(scalars, iteration)
        self.interval = IntervalStats()
        if self.is_logging_rank:
            self._print(line)
            return line
        return None

    def median_tokens_per_s(self) -> float | None:
        """The median over the logged intervals (the first one's start-up counts once); None before any."""
        return statistics.median(self.interval_tokens_per_s) if self.interval_tokens_per_s else None

    def _print(self, text: str) -> None:
        if self.run_log is not None:
            self.run_log.print(text)
        else:
            print(text, flush=True)

    def _write(self, scalars: dict[str, float | None], iteration: int) -> None:
        present = {tag: value for tag, value in scalars.items() if value is not None}
        for writer in self.writers:
            writer.write(present, iteration)

    @staticmethod
    def _comm_scalars(comm: CommStepStats) -> dict[str, float | None]:
        out = {}
        for kind, m in comm.measured.items():
            for name, value in (("count", m.count), ("bytes", m.nbytes), ("seconds", m.seconds),
                                ("wait_seconds", m.wait_seconds), ("theory_bytes", comm.theory[kind].nbytes),
                                ("bytes_vs_theory", comm.bytes_vs_theory(kind))):
                out[f"comm/{kind}_{name}"] = value
        return out

    def log_eval(self, iteration: int, loss: float, split: str = "validation") -> None:
        if not self.is_logging_rank:
            return
        ppl = math.exp(min(20.0, loss))
        self._print("-" * 100 + f"\n {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                    f"lm loss PPL: {ppl:.6E} |\n" + "-" * 100)
        scalars = {f"lm loss {split}": loss}
        if self.cfg.log_validation_ppl:
            scalars[f"lm loss {split} ppl"] = ppl
        self._write(scalars, iteration)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
