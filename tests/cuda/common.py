"""The zero_cache tests' tiny model and fp32 reference (tests/zero_cache/common.py), runnable on a GPU."""
from __future__ import annotations

import torch

from tests.zero_cache.common import BETAS, CLIP, EPS, LR, WD, TinyGPT, batches, make_model


def make_device_model(device: torch.device, seed: int = 0) -> TinyGPT:
    """common.make_model's model, with the same initial weights, on ``device``."""
    return make_model(seed).to(device)


def device_reference(device: torch.device, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process fp32 on ``device``: the model and torch AdamW on each whole global batch.

    Returns the loss of every step and the final weights (CPU copies)."""
    model = make_device_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = batches(steps).to(device)
    losses = []
    for s in range(steps):
        loss = model(data[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
