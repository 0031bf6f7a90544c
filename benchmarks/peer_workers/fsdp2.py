"""PyTorch FSDP2 (``fully_shard`` per transformer layer, then the root), optionally with CPUOffloadPolicy; in
bf16 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 sharded parameters. On one rank
``reshard_after_forward=False``: there a "shard" is the whole parameter, and freeing the gathered copy after the
forward only to gather it again for the backward is a copy for nothing. ``BenchSpec.hsdp_shard_size`` N > 0: HSDP,
sharded over blocks of N ranks and replicated across them (a 2-D mesh, fully_shard's hybrid layout)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .harness import BETAS, EPS, BenchSpec, param_groups


class Fsdp2Trainer:
    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        cuda = spec.device == "cuda"
        # fully_shard moves the (CPU-built) model to the mesh's device, or keeps the shards on the host with
        # CPUOffloadPolicy, pinned where a GPU copies from them.
        mesh = _mesh("cuda" if cuda else "cpu", dist.get_world_size(), spec.hsdp_shard_size)
        policy = CPUOffloadPolicy(pin_memory=cuda) if offload else OffloadPolicy()
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if spec.dtype == "bf16" else MixedPrecisionPolicy()
        reshard = dist.get_world_size() > 1
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy, mp_policy=mixed, reshard_after_forward=reshard)
        # The root: embedding, final norm, tied head.
        fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mixed, reshard_after_forward=reshard)
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


def _mesh(device: str, world: int, hsdp_shard_size: int):
    """A 1-D mesh over every rank (full shard), or HSDP's 2-D one: dim 0 replicates across the blocks of
    ``hsdp_shard_size`` consecutive ranks, dim 1 shards inside a block (init_device_mesh lays ranks out row-major)."""
    if hsdp_shard_size <= 0:
        return init_device_mesh(device, (world,))
    if world % hsdp_shard_size:
        raise ValueError(f"hsdp_shard_size {hsdp_shard_size} does not divide the {world} ranks; give a divisor "
                         "(the ranks per host)")
    return init_device_mesh(device, (world // hsdp_shard_size, hsdp_shard_size),
                            mesh_dim_names=("replicate", "shard"))
