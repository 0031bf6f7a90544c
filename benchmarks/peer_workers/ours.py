"""Ours: the zero_cache ZeRO-3 engine, built and driven as megatron/training/backends/zero.py does."""
from __future__ import annotations

import torch

import zero_cache
from megatron.core import parallel_state as ps
from megatron.core.deferred_init import initial_value
from megatron.core.distributed.data_parallel import is_expert_param

from .harness import COLLECTIVE_TIMEOUT, BenchSpec, build_model, compute_device, moe_step_stats


def engine_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainer's groups (backends/zero.py): decay on dense matrices, none on biases and norms; a mixture of
    experts' weights in a group of their own, sharded over the ranks that hold the same experts and scaled by
    1 / data-parallel size (each expert saw the whole data-parallel group's tokens)."""
    dense = [p for p in model.parameters() if not is_expert_param(p)]
    groups = [{"params": [p for p in dense if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0}]
    experts = [p for p in model.parameters() if is_expert_param(p)]
    if experts:
        groups.append({"params": experts, "weight_decay": weight_decay,
                       "dp_group": ps.get_expert_data_parallel_group(),
                       "gradient_scaling_factor": 1.0 / ps.get_data_parallel_world_size()})
    return [g for g in groups if g["params"]]


class ZeroCacheTrainer:
    @staticmethod
    def build_model(spec: BenchSpec, offload: bool) -> torch.nn.Module:
        """As the trainer does under --deepspeed: built on the meta device in the compute precision (the engine
        keeps fp32 masters itself), then filled by the engine chunk by chunk on the compute device."""
        ps.initialize_model_parallel(1, 1, timeout=COLLECTIVE_TIMEOUT,
                                     expert_model_parallel_size=spec.expert_parallel)
        with torch.device("meta"):
            model = build_model(spec, spec.dtype)
        return zero_cache.storage_less_parameters(model, compute_device(spec))

    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        world = ps.get_data_parallel_world_size()
        self.engine = zero_cache.initialize(model, spec.ds_config(world, offload),
                                            dp_group=ps.get_data_parallel_group(),
                                            model_parallel_group=ps.get_model_parallel_group(),
                                            param_groups=engine_param_groups(model, spec.weight_decay),
                                            param_init=initial_value)
        # The tied output head reads the embedding's weight outside the embedding module.
        self.engine.register_external_parameter(model.output_layer, model.embedding.word_embeddings.weight)
        # The routers' balancing losses get the language-model loss's backward factor (what the trainer's
        # schedule sets): engine.backward multiplies by loss_scale / gradient_accumulation_steps.
        model.set_moe_aux_loss_scale(self.engine.loss_scale / gas)
        self.model = model

    def micro_batch(self, tokens, position_ids, labels, last: bool) -> torch.Tensor:
        loss = self.engine(tokens, position_ids, None, labels=labels).mean()
        self.engine.backward(loss)  # x loss_scale / gradient_accumulation_steps
        if last:
            self.engine.step()
        return loss.detach()

    def step_stats(self) -> dict:
        return moe_step_stats(self.model)
