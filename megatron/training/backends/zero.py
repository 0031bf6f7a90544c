"""Training through the zero_cache engine (``--deepspeed --deepspeed_config ds.json``).

ZeRO shards model states over the data-parallel group of each tensor/pipeline
position; the engine reduces gradients itself (hook-driven, so the 1F1B
schedule's stage-to-stage ``torch.autograd.backward`` calls work unchanged).
The engine's config is ``Config.zero_cache``: the JSON merged with the Megatron
flags and parsed once by ``parse_args`` (``megatron/training/zero_config.py``).
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Callable

import torch

import zero_cache
from megatron.core import parallel_state as ps
from megatron.core.deferred_init import initial_value
from megatron.core.distributed.data_parallel import is_expert_param
from megatron.core.pipeline_parallel.model_chunks import model_chunks
from megatron.core.tensor_parallel import param_is_tensor_parallel_duplicate
from megatron.training.backends.base import Backend, BackendStepResult
from megatron.training.checkpoint import names
from megatron.training.checkpoint.checkpointer import write_tracker
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.layout import layout_function
from megatron.training.checkpoint.rng import get_rng_state, set_rng_state, to_plain
from megatron.training.config import Config, ConfigError
from zero_cache.checkpoint import CheckpointError, sharded
from zero_cache.checkpoint.names import default_tag

if TYPE_CHECKING:
    from zero_cache.checkpoint.distributed import Layout
    from zero_cache.checkpoint.interface import StateSource


def build_lazy_model(build: Callable[[], torch.nn.Module], device: torch.device) -> torch.nn.Module:
    """``build()`` on the meta device (no memory), then give the parameters storage-less tensors on ``device``;
    ``zero_cache.initialize(param_init=initial_value)`` materialises them one chunk at a time."""
    with torch.device("meta"):
        model = build()
    for module in model.modules():  # the GPT's buffers (MoE routers' expert bias and counts) start at zero
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    return zero_cache.storage_less_parameters(model, device)


def step_result(result: zero_cache.StepResult) -> BackendStepResult:
    """The engine's step report as the training loop's."""
    return BackendStepResult(update_successful=not result.skipped, grad_norm=result.grad_norm,
                             loss_scale=result.loss_scale)


class ZeroBackend(Backend):
    """The zero_cache engine behind the trainer's ``Backend``; the engine owns the optimizer."""

    def __init__(self, cfg: Config, model: torch.nn.Module):
        self.module = model
        dense = [p for p in model.parameters() if not is_expert_param(p)]
        groups = [{"params": [p for p in dense if p.ndim >= 2], "weight_decay": cfg.optimizer.weight_decay},
                  {"params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0}]
        experts = [p for p in model.parameters() if is_expert_param(p)]
        if experts:  # sharded over the ranks that hold the same experts; each saw the whole DP group's tokens
            groups.append({"params": experts, "weight_decay": cfg.optimizer.weight_decay,
                           "dp_group": ps.get_expert_data_parallel_group(),
                           "gradient_scaling_factor": 1.0 / ps.get_data_parallel_world_size()})
        tied = []
        shared = model.shared_embedding_weight()
        if shared is not None:
            tied.append((shared, ps.get_embedding_group()))
        try:
            self.model = zero_cache.initialize(
                model, config=cfg.zero_cache, dp_group=ps.get_data_parallel_group(with_context_parallel=True),
                model_parallel_group=ps.get_model_parallel_group(),
                param_in_grad_norm=lambda p: not getattr(p, "shared", False)
                and not param_is_tensor_parallel_duplicate(p),
                tied_param_groups=tied,
                param_groups=[g for g in groups if g["params"]],
                param_init=initial_value)
        except zero_cache.ZeroConfigError as e:
            raise ConfigError(str(e)) from None
        for chunk in model_chunks(model):  # one, or the interleaved schedule's chunks of this stage
            if chunk.post_process and chunk.pre_process and chunk.output_layer.weight is None:
                # The tied output head reads the embedding's weight outside the embedding module.
                self.model.register_external_parameter(chunk.output_layer, chunk.embedding.word_embeddings.weight)
        self.optimizer = None  # the engine owns the optimizer; the LR comes in through step(lr)

    def zero_grad(self) -> None:
        """Gradients live in the engine's shards and are consumed by step()."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.model.loss_scale

    def backward_pass(self, last_of_chunk: bool, last_of_step: bool) -> contextlib.AbstractContextManager:
        """The engine reduce-scatters every pass into its shards; it is told which pass is the step's last."""
        self.model.set_gradient_accumulation_boundary(last_of_step)
        return contextlib.nullcontext()

    def deferred_weight_grads(self) -> contextlib.AbstractContextManager:
        return self.model.deferred_weight_grads()

    def backward_weights(self, kept) -> None:
        self.model.backward_weights(kept)

    def finish_grad_sync(self) -> None:
        """step() waits for the outstanding reduce-scatters and syncs tied embeddings."""

    def step(self, lr: float) -> BackendStepResult:
        return step_result(self.model.step(lr=lr))

    def checkpoint_states(self) -> StateSource:
        self.model.states.prepare_checkpoint()  # the last update finishes; SSD read-ahead is handed back
        return self.model.states

    def checkpoint_layout(self) -> Layout:
        return layout_function(self.module)

    def save_legacy_checkpoint(self, cfg: CheckpointConfig, iteration: int, scheduler, *, consumed_samples: int,
                               args: dict, rng_tracker) -> None:
        """Each rank writes its own shards (no full model anywhere) under ``global_step<N>``, then the trackers."""
        client = {"iteration": iteration, "consumed_samples": consumed_samples, "args": to_plain(dict(args), "args"),
                  "opt_param_scheduler": scheduler.state_dict(), "rng_state": to_plain(get_rng_state(rng_tracker))}
        self.model.save_sharded_checkpoint(cfg.save, tag=default_tag(iteration), client_state=client)
        if torch.distributed.get_rank() == 0:  # Megatron's tracker too, so tools find the iteration
            write_tracker(cfg.save, iteration)
        torch.distributed.barrier()

    def load_legacy_checkpoint(self, cfg: CheckpointConfig, iteration: int, scheduler, rng_tracker
                               ) -> tuple[int, int]:
        tag = default_tag(iteration)
        if not sharded.is_sharded_checkpoint(os.path.join(cfg.load, tag)):
            raise CheckpointError(f"{cfg.load} holds no checkpoint of iteration {iteration} (neither "
                                  f"{names.iteration_dirname(iteration)}/ nor {tag}/ with zero_pp_rank files); "
                                  f"restore it or point {names.tracker_path(cfg.load)} at an earlier iteration")
        load_optim = not (cfg.no_load_optim or cfg.finetune)
        _, client = self.model.load_checkpoint(cfg.load, tag=tag, load_optimizer_states=load_optim)
        if load_optim:
            scheduler.load_state_dict(client["opt_param_scheduler"])
        if not (cfg.no_load_rng or cfg.finetune):
            set_rng_state(client["rng_state"], rng_tracker)
        if cfg.finetune:
            return 0, 0
        return int(client["iteration"]), int(client["consumed_samples"])

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered over the data-parallel group (each rank holds 1/N of every shard)."""
        return self.model.gather_state_dict(rank0_only=False)

    def memory_tiers(self) -> dict[str, float]:
        report = self.model.memory_report()
        return {f"{tier} states": float(n) for tier, n in report.by_tier.items()}

    def finish(self) -> None:
        self.model.finish_update()  # an update left to run under the next forward (states on SSD) ends here

    def shared_copy_streams(self) -> zero_cache.streams.Streams:
        """The engine's copy streams: activation offload queues behind the parameter and gradient copies."""
        return self.model.streams

    def comm_stats(self) -> zero_cache.comm.CommStepStats | None:
        """The last step's collectives on this rank's data-parallel group next to the ZeRO theory (None
        unless the JSON sets zero_optimization.is_communication_time_profiling)."""
        return self.model.last_comm_stats
