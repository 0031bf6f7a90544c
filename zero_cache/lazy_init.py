"""Models too big to build: parameters without storage, filled chunk by chunk by the engine.

A model built under ``with torch.device("meta")`` costs no memory. ``storage_less_parameters`` swaps its
meta parameters for parameters on the compute device whose storage is empty (attributes copied, every
module that shares a parameter gets the same new object), which the engine can bind into its flat
chunks. ``initialize(..., param_init=fn)`` then asks ``fn(name, param)`` for each such parameter's initial
values while it builds one chunk at a time, so the full model never exists in memory.
"""
from __future__ import annotations

import torch
from torch import nn


def has_no_storage(p: torch.Tensor) -> bool:
    return p.numel() > 0 and p.untyped_storage().nbytes() == 0


def storage_less_parameters(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Replace every meta parameter of ``model`` (in place) by a storage-less one on ``device``."""
    device = torch.device(device)
    new_of: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            q = new_of.get(id(p))
            if q is None:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.untyped_storage().resize_(0)
                q = nn.Parameter(t, requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)  # tensor-parallel attributes, deferred initializer, ...
                new_of[id(p)] = q
            module._parameters[name] = q
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(f"buffer '{name}' is on the meta device; buffers must be real (compute them in "
                             f"forward or build them outside the meta context)")
    return model
