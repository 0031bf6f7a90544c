"""How gradients are synchronised and parameters updated: Megatron DDP + optimizer, or the zero_cache engine.

The training loop only sees this small interface, so the same schedule and
loop drive both: the backend holds the wrapped model (what the pipeline
schedule runs), reduces gradients across data-parallel ranks, keeps tied
embedding copies equal across pipeline stages, and steps the optimizer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from megatron.training.config import Config


@dataclass(frozen=True)
class StepResult:
    update_successful: bool
    grad_norm: float | None
    loss_scale: float


def allreduce_shared_embedding_grad(model: torch.nn.Module) -> None:
    """Sum the gradients of the word-embedding copies held by the first and last pipeline stage."""
    weight = model.shared_embedding_weight()
    if weight is None:
        return
    grad = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
    dist.all_reduce(grad, group=ps.get_embedding_group())


class MegatronBackend:
    """Bucketed data-parallel all-reduce overlapped with backward, then a (mixed-precision) AdamW step."""

    def __init__(self, cfg: Config, model: torch.nn.Module):
        self.module = model
        self.model = DistributedDataParallel(model, ps.get_data_parallel_group())
        self.optimizer = get_megatron_optimizer(cfg.optimizer, [model], ps.get_data_parallel_group(),
                                                ps.get_model_parallel_group())

    def save_checkpoint(self, cfg: CheckpointConfig, iteration: int, scheduler, *, consumed_samples: int,
                        args: dict, rng_tracker) -> None:
        save_checkpoint(cfg, iteration, self.module, self.optimizer, scheduler, consumed_samples=consumed_samples,
                        args=args, rng_tracker=rng_tracker)

    def load_checkpoint(self, cfg: CheckpointConfig, scheduler, rng_tracker) -> tuple[int, int]:
        return load_checkpoint(cfg, self.module, self.optimizer, scheduler, rng_tracker)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.model.no_sync()

    def finish_grad_sync(self) -> None:
        self.model.finish_grad_sync()
        allreduce_shared_embedding_grad(self.module)

    def step(self, lr: float) -> StepResult:
        self.optimizer.set_lr(lr)
        ok, grad_norm, _ = self.optimizer.step()
        return StepResult(ok, grad_norm, self.optimizer.get_loss_scale())

    def memory_tiers(self) -> dict[str, float]:
        return {}

    def comm_stats(self) -> None:
        """Communication profiling is a zero_cache engine feature (--deepspeed)."""
        return None

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's (TP/PP-partitioned) weights, as fp32 copies."""
        return {n: p.detach().float().clone() for n, p in self.module.named_parameters()}


def build_model(cfg: Config, model_provider, model_cfg, rng_tracker, device: torch.device) -> torch.nn.Module:
    """The model on ``device``; under --deepspeed it is built without memory and the engine fills it chunk
    by chunk (a model bigger than host memory can be trained), see zero_backend.build_lazy_model."""
    if cfg.deepspeed.enabled:
        from megatron.training.zero_backend import build_lazy_model
        return build_lazy_model(model_provider, model_cfg, rng_tracker, device)
    return model_provider(model_cfg, rng_tracker).to(device)


def build_backend(cfg: Config, model: torch.nn.Module):
    """The zero_cache engine under --deepspeed, else Megatron's DDP + optimizer."""
    if cfg.deepspeed.enabled:
        from megatron.training.zero_backend import ZeroBackend
        return ZeroBackend(cfg, model)
    return MegatronBackend(cfg, model)
