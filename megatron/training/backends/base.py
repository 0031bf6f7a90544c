"""The training loop's view of a backend: how gradients are synchronised and parameters updated.

The training loop sees only ``Backend``, so the same schedule and loop drive both implementations, Megatron
DDP + optimizer (``ddp.py``) and the zero_cache engine (``zero.py``): the backend holds the wrapped model
(what the pipeline schedule runs), reduces gradients across data-parallel ranks, keeps tied embedding copies
equal across pipeline stages, steps the optimizer and saves / loads its state.
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron.core.optimizer import MegatronOptimizer
from megatron.training.checkpoint.config import CheckpointConfig
from zero_cache.streams import Streams

if TYPE_CHECKING:
    from megatron.core.tensor_parallel import RNGStatesTracker
    from megatron.training.lr_scheduler import OptimizerParamScheduler
    from zero_cache import ZeroEngine
    from zero_cache.checkpoint.distributed import Layout
    from zero_cache.checkpoint.interface import StateSource
    from zero_cache.comm import CommStepStats


@dataclass(frozen=True)
class BackendStepResult:
    """What one optimizer step reports to the training loop."""
    update_successful: bool  # False when the step was skipped (fp16 overflow, non-finite gradient norm)
    grad_norm: float | None  # global gradient L2 norm before clipping; None or non-finite on a skipped step
    loss_scale: float  # the loss scale this step's gradients were scaled by (1.0 without loss scaling)


class Backend(abc.ABC):
    """The training loop's view of gradient synchronisation and parameter updates.

    ``model`` is what the pipeline schedule runs (called per micro-batch, ``train()``/``eval()``, the bare
    model at ``model.module``); ``optimizer`` is the optimizer the learning-rate scheduler writes into, or
    None when the backend takes the learning rate through ``step(lr)`` only.
    """
    model: torch.nn.Module | ZeroEngine
    optimizer: MegatronOptimizer | None

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear the gradients before the step's first micro-batch."""

    @abc.abstractmethod
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss times the current loss scale, before backward."""

    @abc.abstractmethod
    def backward_pass(self, last_of_chunk: bool, last_of_step: bool) -> contextlib.AbstractContextManager:
        """Around one backward pass of the pipeline schedule (``megatron.core.pipeline_parallel.backward_passes``):
        the last passes of a model chunk and of the step are where the data-parallel reduction completes."""

    def deferred_weight_grads(self) -> contextlib.AbstractContextManager:
        """Around the input-gradient pass of a split backward (zero-bubble schedules); yields the weight
        gradients kept for ``backward_weights``."""
        raise NotImplementedError(f"{type(self).__name__} cannot split a backward")

    def backward_weights(self, kept) -> None:
        """The weight pass of a split backward."""
        raise NotImplementedError(f"{type(self).__name__} cannot split a backward")

    @abc.abstractmethod
    def finish_grad_sync(self) -> None:
        """Wait for the step's gradient reductions, including the tied embedding's across pipeline stages."""

    @abc.abstractmethod
    def step(self, lr: float) -> BackendStepResult:
        """Update the parameters at learning rate ``lr`` (skipped on fp16 overflow)."""

    @abc.abstractmethod
    def checkpoint_states(self) -> StateSource:
        """The model states behind zero_cache's checkpoint interface, ready to be saved or loaded now."""

    @abc.abstractmethod
    def checkpoint_layout(self) -> Layout:
        """Where each local parameter lies in the model's mesh-independent global tensors."""

    @abc.abstractmethod
    def save_legacy_checkpoint(self, cfg: CheckpointConfig, iteration: int, scheduler: OptimizerParamScheduler, *,
                               consumed_samples: int, args: dict, rng_tracker: RNGStatesTracker) -> None:
        """``--ckpt-format torch``: write ``iteration`` in the backend's per-rank layout (loads only into the
        same mesh). Collective: every rank calls it."""

    @abc.abstractmethod
    def load_legacy_checkpoint(self, cfg: CheckpointConfig, iteration: int, scheduler: OptimizerParamScheduler,
                               rng_tracker: RNGStatesTracker) -> tuple[int, int]:
        """Restore ``iteration`` from the backend's per-rank layout under ``cfg.load``; returns (iteration,
        consumed samples), (0, 0) with ``cfg.finetune``."""

    @abc.abstractmethod
    def memory_tiers(self) -> dict[str, float]:
        """Bytes of model states per memory tier, for the log line ({} when not tracked)."""

    @abc.abstractmethod
    def comm_stats(self) -> CommStepStats | None:
        """The last step's collectives next to the ZeRO theory, for the log (None when not profiled)."""

    @abc.abstractmethod
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's (tensor/pipeline-partitioned) weights as fp32 copies."""

    def shared_copy_streams(self) -> Streams | None:
        """Copy streams the backend already runs that activation offload should share (the ZeRO engine's);
        None: offload makes the device's own."""
        return None

    def finish(self) -> None:  # noqa: B027 (only the zero_cache backend has an update left in flight)
        """End of training: wait for any update still in flight, raising its error (nothing by default)."""
