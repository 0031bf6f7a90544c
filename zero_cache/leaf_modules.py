"""Modules the ZeRO-3 coordinator treats as one unit (DeepSpeed's "ZeRO-3 leaf modules").

By default the coordinator hooks every module that owns parameters: each linear layer gathers its own weights
just before it runs. A leaf module is hooked instead of everything inside it: all its parameters are gathered
before it runs and released after it, and nothing inside it sees a hook. That is what a compiled block needs
(the hooks stay outside the compiled region) and what a block with data-dependent control flow needs (a
mixture-of-experts layer whose experts run in an order the trace cannot predict).
"""
from __future__ import annotations

from collections.abc import Iterable

from torch import nn

_MARK = "_z3_leaf"


def set_z3_leaf_module(module: nn.Module) -> None:
    """Treat ``module`` as one unit (call before ``zero_cache.initialize``)."""
    setattr(module, _MARK, True)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable[type[nn.Module]]) -> list[nn.Module]:
    """Treat every module of ``model`` of one of ``leaf_module_classes`` as one unit; returns them."""
    classes = tuple(leaf_module_classes)
    leaves = [m for m in model.modules() if isinstance(m, classes)]
    for m in leaves:
        set_z3_leaf_module(m)
    return leaves


def z3_leaf_module(module: nn.Module) -> bool:
    return getattr(module, _MARK, False)
