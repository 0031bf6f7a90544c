"""Ours: the zero_cache ZeRO-3 engine, built and driven as megatron/training/backends/zero.py does."""
from __future__ import annotations

import torch

import zero_cache
from megatron.core import parallel_state as ps
from megatron.core.deferred_init import initial_value

from .harness import COLLECTIVE_TIMEOUT, BenchSpec, build_model, compute_device, param_groups


class ZeroCacheTrainer:
    @staticmethod
    def build_model(spec: BenchSpec, offload: bool) -> torch.nn.Module:
        """As the trainer does under --deepspeed: built on the meta device in the compute precision (the engine
        keeps fp32 masters itself), then filled by the engine chunk by chunk on the compute device."""
        ps.initialize_model_parallel(1, 1, timeout=COLLECTIVE_TIMEOUT)
        with torch.device("meta"):
            model = build_model(spec, spec.dtype)
        return zero_cache.storage_less_parameters(model, compute_device(spec))

    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        world = ps.get_data_parallel_world_size()
        self.engine = zero_cache.initialize(model, spec.ds_config(world, offload),
                                            dp_group=ps.get_data_parallel_group(),
                                            model_parallel_group=ps.get_model_parallel_group(),
                                            param_groups=param_groups(model, spec.weight_decay),
                                            param_init=initial_value)
        # The tied output head reads the embedding's weight outside the embedding module.
        self.engine.register_external_parameter(model.output_layer, model.embedding.word_embeddings.weight)

    def micro_batch(self, tokens, position_ids, labels, last: bool) -> torch.Tensor:
        loss = self.engine(tokens, position_ids, None, labels=labels).mean()
        self.engine.backward(loss)  # x loss_scale / gradient_accumulation_steps
        if last:
            self.engine.step()
        return loss.detach()
