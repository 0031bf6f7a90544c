"""DeepSpeed ZeRO-3, given the same JSON as ours: on its CPU accelerator (DS_ACCELERATOR=cpu, gloo), or on one
GPU per rank (DS_ACCELERATOR=cuda, NCCL) where DeepSpeed is installed."""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist

from .harness import BenchSpec, build_model, param_groups


class DeepSpeedTrainer:
    @staticmethod
    def build_model(spec: BenchSpec, offload: bool) -> torch.nn.Module:
        """Under deepspeed.zero.Init (DeepSpeed's way for ZeRO-3): each module is partitioned as it is created."""
        # Adopts the process group the harness created.
        deepspeed.init_distributed(dist_backend="nccl" if spec.device == "cuda" else "gloo")
        config = spec.ds_config(dist.get_world_size(), offload)
        remote = spec.offload_device if offload else None
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote,
                                 pin_memory=offload and spec.device == "cuda"):
            return build_model(spec)

    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, spec.weight_decay),
                                               config=spec.ds_config(dist.get_world_size(), offload))
        # DeepSpeed's rule for a parameter used outside its module's forward (the tied output head); an untied
        # head reads its own weight, and registering the embedding would gather it there for nothing.
        if model.output_layer.weight is None:
            deepspeed.zero.register_external_parameter(model.output_layer, model.embedding.word_embeddings.weight)

    def micro_batch(self, tokens, position_ids, labels, last: bool) -> torch.Tensor:
        # DeepSpeed counts micro-batches itself and updates at its accumulation boundary: it must be ours.
        if self.engine.is_gradient_accumulation_boundary() != last:
            raise RuntimeError(f"DeepSpeed's accumulation boundary (micro step {self.engine.micro_steps}) is not "
                               f"the harness's last micro-batch ({last}); check gradient_accumulation_steps")
        loss = self.engine(tokens, position_ids, None, labels=labels).mean()
        self.engine.backward(loss)  # / gradient_accumulation_steps
        self.engine.step()
        return loss.detach()
