"""Building a model that does not fit in memory: parameters on the meta device carry their initializer.

Under ``with torch.device("meta")`` every parameter is created without storage. Each creation site in
this package attaches ``param.deferred_init``, a function returning the parameter's initial values
(fp32, the parameter's local shape), and the ZeRO engine calls it one chunk at a time while it shards
the model (``initial_value`` is the ``param_init`` the trainer hands to ``zero_cache.initialize``). Off
the meta device the same sites initialise in place, so both paths give bit-identical weights.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def init_or_defer(param: torch.Tensor, make: Callable[[], torch.Tensor]) -> None:
    """Fill ``param`` with ``make()`` now, or (meta device) remember ``make`` for the engine."""
    if param.is_meta:
        param.deferred_init = make
    else:
        with torch.no_grad():
            param.copy_(make())


def init_whole(param: torch.Tensor, init_method: Callable[[torch.Tensor], None]) -> None:
    """A parameter every rank holds whole: ``init_method`` on an fp32 tensor of its shape, now or deferred."""
    shape = tuple(param.shape)

    def make() -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device="cpu")
        init_method(t)
        return t

    init_or_defer(param, make)


def defer_constant(param: torch.Tensor | None, value: float) -> None:
    """A parameter created already filled with ``value`` (biases, norm weights): record it when on meta."""
    if param is not None and param.is_meta:
        shape = tuple(param.shape)
        param.deferred_init = lambda: torch.full(shape, value, dtype=torch.float32)


def defer_norm(norm: nn.Module) -> nn.Module:
    defer_constant(norm.weight, 1.0)
    defer_constant(getattr(norm, "bias", None), 0.0)
    return norm


def initial_value(name: str, param: torch.Tensor) -> torch.Tensor:
    make = getattr(param, "deferred_init", None)
    if make is None:
        raise ValueError(f"parameter '{name}' was built on the meta device without an initializer; create it "
                         f"through megatron.core.deferred_init (init_or_defer / defer_constant)")
    value = make()
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"initializer of '{name}' returned shape {tuple(value.shape)}, expected "
                         f"{tuple(param.shape)}")
    return value
