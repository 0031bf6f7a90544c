"""PyTorch FSDP2 (``fully_shard`` per transformer layer, then the root), optionally with CPUOffloadPolicy."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from .harness import BETAS, EPS, BenchSpec, param_groups


class Fsdp2Trainer:
    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)  # embedding, final norm and the tied head
        self.model, self.gas, self.clip = model, gas, spec.clip_grad
        # Groups are built after sharding: fully_shard replaces the parameters with DTensor shards.
        self.optimizer = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=BETAS, eps=EPS,
                                           fused=True)

    def micro_batch(self, tokens, position_ids, labels, last: bool) -> torch.Tensor:
        loss = self.model(tokens, position_ids, None, labels=labels).mean()
        (loss / self.gas).backward()  # reduce-scatters every micro-batch into the sharded gradients
        if last:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
