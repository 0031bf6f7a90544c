"""ZeRO-Cache: a generic ZeRO (stages 1-3) memory engine for any torch ``nn.Module``."""
from .aio import SSDTierError
from .config import ZeroCacheConfig, ZeroConfigError, parse_config
from .engine import StepResult, ZeroEngine, initialize
from .lazy_init import storage_less_parameters
from .ssd_store import SSDStore
from .store import DeviceHostStore, MemoryReport, ShardStore

__all__ = ["initialize", "storage_less_parameters", "ZeroEngine", "StepResult", "ZeroCacheConfig", "ZeroConfigError",
           "parse_config", "ShardStore", "DeviceHostStore", "SSDStore", "SSDTierError", "MemoryReport"]
