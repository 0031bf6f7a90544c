"""Packages only some input formats need (pyarrow, zstandard), imported when such input is read."""
from __future__ import annotations

import importlib
from types import ModuleType


def optional_package(modules: tuple[str, ...], path: str, what: str) -> tuple[ModuleType, ...]:
    """``modules`` of one package, or one clear error naming ``path``, what needs it and the pip command."""
    package = modules[0].split(".")[0]
    try:
        return tuple(importlib.import_module(m) for m in modules)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != package:
            raise
        raise ValueError(f"{path}: {what}, which is not installed: pip install {package}") from None
