"""ZeRO-Cache: a generic ZeRO (stages 1-3) memory engine for any torch ``nn.Module``."""
from .config import ConfigError, ZeroCacheConfig, parse_config
from .engine import StepResult, ZeroEngine, initialize
from .store import DeviceHostStore, MemoryReport, ShardStore

__all__ = ["initialize", "ZeroEngine", "StepResult", "ZeroCacheConfig", "ConfigError", "parse_config",
           "ShardStore", "DeviceHostStore", "MemoryReport"]
