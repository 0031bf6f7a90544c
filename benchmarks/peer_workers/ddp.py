"""Plain PyTorch DDP (every rank holds all model states): the reference the other systems' losses must match."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from .harness import BETAS, EPS, BenchSpec, compute_device, moe_step_stats, param_groups


class DdpTrainer:
    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        if offload:
            raise ValueError("DDP has no CPU offload; run it without --offload")
        if spec.dtype != "fp32":
            # The fp32 reference; in bf16 a peer is (benchmarks/gpu_peers.py REFERENCES).
            raise ValueError(f"DDP is the fp32 loss reference; it does not run {spec.dtype}")
        device = compute_device(spec)
        model = model.to(device)
        self.module = model
        self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.gas, self.clip = gas, spec.clip_grad
        model.set_moe_aux_loss_scale(1.0 / gas)  # a mixture of experts' balancing losses: the loss's factor below
        self.optimizer = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=BETAS, eps=EPS,
                                           fused=True)

    def micro_batch(self, tokens, position_ids, labels, last: bool) -> torch.Tensor:
        with contextlib.nullcontext() if last else self.model.no_sync():  # all-reduce once per global batch
            loss = self.model(tokens, position_ids, None, labels=labels).mean()
            (loss / self.gas).backward()
        if last:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def step_stats(self) -> dict:
        return moe_step_stats(self.module)
