"""ZeRO-Cache: a generic ZeRO (stages 1-3) memory engine for any torch ``nn.Module``.

The names below load on first use, so that ``zero_cache.config`` (what a trainer's argument parser needs to
read a DeepSpeed JSON) does not bring in the engine.
"""
from importlib import import_module

_LAZY = {
    "initialize": ".engine", "ZeroEngine": ".engine", "StepResult": ".engine",
    "storage_less_parameters": ".lazy_init",
    "ZeroCacheConfig": ".config", "ZeroConfigError": ".config", "parse_config": ".config",
    "ShardStore": ".store", "DeviceHostStore": ".store", "MemoryReport": ".store",
    "SSDStore": ".ssd_store", "SSDTierError": ".aio",
    "ActivationOffloader": ".activation_offload", "ActivationOffloadOptions": ".activation_offload",
    "ActivationOffloadStats": ".activation_offload",
    "set_z3_leaf_modules": ".leaf_modules", "set_z3_leaf_module": ".leaf_modules", "z3_leaf_module": ".leaf_modules",
}

__all__ = [*_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'zero_cache' has no attribute {name!r}")
