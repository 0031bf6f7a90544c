"""Megatron's data-parallel backend: bucketed gradient all-reduce overlapped with backward, then a
(mixed-precision) AdamW step; every rank holds whole parameters and the optimizer's states."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel.model_chunks import model_chunks
from megatron.training.backends.base import Backend, BackendStepResult
from megatron.training.checkpoint import legacy
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.ddp_states import DataParallelStates
from megatron.training.checkpoint.layout import layout_function
from megatron.training.config import Config

if TYPE_CHECKING:
    from zero_cache.checkpoint.distributed import Layout
    from zero_cache.checkpoint.interface import StateSource


def allreduce_shared_embedding_grad(model: torch.nn.Module) -> None:
    """Sum the gradients of the word-embedding copies held by the first and last pipeline stage."""
    weight = model.shared_embedding_weight()
    if weight is None:
        return
    grad = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
    dist.all_reduce(grad, group=ps.get_embedding_group())


class MegatronBackend(Backend):
    """Bucketed data-parallel all-reduce overlapped with backward, then a (mixed-precision) AdamW step."""

    def __init__(self, cfg: Config, model: torch.nn.Module):
        self.module = model
        # Context-parallel ranks hold the same weights and see other tokens: they reduce gradients with DP.
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        self.model = DistributedDataParallel(model, dp_cp,
                                             expert_data_parallel_group=ps.get_expert_data_parallel_group())
        experts = ps.get_expert_model_parallel_and_model_parallel_group() if cfg.model.moe is not None else None
        self.optimizer = get_megatron_optimizer(cfg.optimizer, [model], dp_cp,
                                                ps.get_model_parallel_group(), experts)

    def checkpoint_states(self) -> StateSource:
        return DataParallelStates(self.module, self.optimizer)

    def checkpoint_layout(self) -> Layout:
        return layout_function(self.module)

    def save_legacy_checkpoint(self, cfg: CheckpointConfig, iteration: int, scheduler, *, consumed_samples: int,
                               args: dict, rng_tracker) -> None:
        legacy.save_checkpoint(cfg, iteration, model_chunks(self.module), self.optimizer, scheduler,
                               consumed_samples=consumed_samples, args=args, rng_tracker=rng_tracker)

    def load_legacy_checkpoint(self, cfg: CheckpointConfig, iteration: int, scheduler, rng_tracker
                               ) -> tuple[int, int]:
        return legacy.load_checkpoint(cfg, model_chunks(self.module), self.optimizer, scheduler, rng_tracker)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def backward_pass(self, last_of_chunk: bool, last_of_step: bool) -> contextlib.AbstractContextManager:
        """All-reduce in a chunk's last backward of the step; hold the reduction back in the others."""
        return contextlib.nullcontext() if last_of_chunk else self.model.no_sync()

    def finish_grad_sync(self) -> None:
        self.model.finish_grad_sync()
        allreduce_shared_embedding_grad(self.module)

    def step(self, lr: float) -> BackendStepResult:
        self.optimizer.set_lr(lr)
        ok, grad_norm, _ = self.optimizer.step()
        return BackendStepResult(ok, grad_norm, self.optimizer.get_loss_scale())

    def memory_tiers(self) -> dict[str, float]:
        return {}

    def comm_stats(self) -> None:
        """Communication profiling is a zero_cache engine feature (--deepspeed)."""
        return None

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in self.module.named_parameters()}
