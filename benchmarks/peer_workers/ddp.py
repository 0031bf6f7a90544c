"""Plain PyTorch DDP (every rank holds all model states): the reference the other systems' losses must match."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from .harness import BETAS, EPS, BenchSpec, param_groups


class DdpTrainer:
    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        if offload:
            raise ValueError("DDP has no CPU offload; run it without --offload")
        self.model, self.gas, self.clip = DistributedDataParallel(model), gas, spec.clip_grad
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
