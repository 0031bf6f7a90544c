"""DeepSpeed-style JSON config, parsed once into typed dataclasses.

Every block is a dataclass whose field names are the JSON keys. Parsing is strict: an unknown key is an
error that names it and suggests the nearest valid key (DeepSpeed silently ignores typos, a known trap);
wrong types and out-of-range values are errors too. The batch-size triple is resolved against the
data-parallel size exactly as DeepSpeed does.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ZeroConfigError(ValueError):
    """A zero_cache config problem; the message names the key and the fix."""


def _check(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise ZeroConfigError(f"zero_cache config: '{path}' {msg}")


def _range(lo=None, hi=None, choices=None):
    """Field metadata: inclusive numeric range or a set of allowed values."""
    return {"lo": lo, "hi": hi, "choices": choices}


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = field(default=0.0, metadata=_range(lo=0.0))  # 0 = dynamic
    initial_scale_power: int = field(default=16, metadata=_range(lo=0, hi=64))
    loss_scale_window: int = field(default=1000, metadata=_range(lo=1))
    hysteresis: int = field(default=2, metadata=_range(lo=1))
    consecutive_hysteresis: bool = False
    min_loss_scale: float = field(default=1.0, metadata=_range(lo=0.0))
    auto_cast: bool = False


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class AdamParams:
    lr: float = field(default=1e-3, metadata=_range(lo=0.0))
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = field(default=1e-8, metadata=_range(lo=0.0))
    weight_decay: float = field(default=0.0, metadata=_range(lo=0.0))


@dataclass
class AdamConfig:
    type: str = field(default="AdamW", metadata=_range(choices=("AdamW", "Adam")))
    params: AdamParams = field(default_factory=AdamParams)


@dataclass
class OffloadParamConfig:
    device: str = field(default="none", metadata=_range(choices=("none", "cpu", "nvme")))
    nvme_path: str = "/local_nvme"
    pin_memory: bool = False
    buffer_count: int = field(default=5, metadata=_range(lo=1))
    buffer_size: int = field(default=100_000_000, metadata=_range(lo=1))
    max_in_cpu: int = field(default=1_000_000_000, metadata=_range(lo=0))


@dataclass
class OffloadOptimizerConfig:
    device: str = field(default="none", metadata=_range(choices=("none", "cpu", "nvme")))
    nvme_path: str = "/local_nvme"
    pin_memory: bool = False
    buffer_count: int = field(default=4, metadata=_range(lo=1))
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = field(default=1.0, metadata=_range(lo=0.0, hi=1.0))


@dataclass
class AioConfig:
    block_size: int = field(default=1_048_576, metadata=_range(lo=4096))
    queue_depth: int = field(default=8, metadata=_range(lo=1))
    intra_op_parallelism: int = field(default=1, metadata=_range(lo=1))
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


@dataclass
class MemoryBudgetConfig:
    """Bytes of model state (plus SSD staging buffers on the host) allowed per tier; -1 = from the machine."""
    device: int = field(default=-1, metadata=_range(lo=-1))
    host: int = field(default=-1, metadata=_range(lo=-1))
    nvme: int = field(default=-1, metadata=_range(lo=-1))


@dataclass
class ZeroOptimizationConfig:
    stage: int = field(default=3, metadata=_range(choices=(1, 2, 3)))
    contiguous_gradients: bool = True
    overlap_comm: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = field(default=500_000_000, metadata=_range(lo=1))
    # Page (flat chunk) size in elements: parameters are packed into pages of at most this many elements.
    allgather_bucket_size: int = field(default=500_000_000, metadata=_range(lo=1))
    sub_group_size: int = field(default=1_000_000_000, metadata=_range(lo=1))
    stage3_prefetch_bucket_size: int = field(default=50_000_000, metadata=_range(lo=0))
    stage3_max_live_parameters: int = field(default=1_000_000_000, metadata=_range(lo=0))
    stage3_max_reuse_distance: int = field(default=1_000_000_000, metadata=_range(lo=0))
    stage3_param_persistence_threshold: int = field(default=100_000, metadata=_range(lo=0))
    stage3_gather_16bit_weights_on_model_save: bool = False
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    # AngelPTM keys.
    pipeline_optimizer: bool = True
    prefetch_cache_sub_group_rate: float = field(default=0.0, metadata=_range(lo=0.0, hi=1.0))
    max_contigous_params_size: int = field(default=-1, metadata=_range(lo=-1))
    max_param_reduce_events: int = field(default=1, metadata=_range(lo=0))
    is_communication_time_profiling: bool = False
    save_large_model_multi_slice: bool = True
    # zero_cache keys.
    memory_budget: MemoryBudgetConfig = field(default_factory=MemoryBudgetConfig)
    lock_free_update: bool = False  # delayed update (one-step-stale parameters), see docs
    # On gloo, all-gather and reduce-scatter as point-to-point exchanges (see comm.py); false: gloo's own.
    gloo_p2p_collectives: bool = True
    # Elements of each state per checkpoint slice file with save_large_model_multi_slice (fp32: 4 bytes
    # each); bounds the host memory of saving and loading (default 64 MiB per state).
    save_large_model_slice_size: int = field(default=16_777_216, metadata=_range(lo=1024))


@dataclass
class ZeroCacheConfig:
    train_batch_size: int | None = field(default=None, metadata=_range(lo=1))
    train_micro_batch_size_per_gpu: int | None = field(default=None, metadata=_range(lo=1))
    gradient_accumulation_steps: int | None = field(default=None, metadata=_range(lo=1))
    gradient_clipping: float = field(default=0.0, metadata=_range(lo=0.0))
    steps_per_print: int = field(default=10, metadata=_range(lo=1))
    wall_clock_breakdown: bool = False
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: AdamConfig = field(default_factory=AdamConfig)
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    aio: AioConfig = field(default_factory=AioConfig)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` (JSON scalars only) and return it normalised."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path)
    if tp is bool:
        _check(isinstance(value, bool), path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        _check(ok, path, f"must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), path,
               f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), path, f"must be a string, got {value!r}")
        return value
    if origin is tuple:
        _check(isinstance(value, (list, tuple)) and len(value) == len(args), path,
               f"must be a list of {len(args)} numbers, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    raise TypeError(f"unsupported config annotation {tp} at {path}")


def _build(cls: type, data: Any, path: str):
    _check(isinstance(data, dict), path or "<root>", f"must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{(path + '.') if path else ''}{near[0]}'?" if near else \
                f"; valid keys here: {', '.join(sorted(fields))}"
            raise ZeroConfigError(f"zero_cache config: unknown key '{full}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, full)
            continue
        value = _coerce(value, tp, full)
        meta = fields[key].metadata
        if meta and value is not None:
            if meta["choices"] is not None:
                _check(value in meta["choices"], full, f"must be one of {list(meta['choices'])}, got {value!r}")
            if meta["lo"] is not None:
                _check(value >= meta["lo"], full, f"must be >= {meta['lo']}, got {value!r}")
            if meta["hi"] is not None:
                _check(value <= meta["hi"], full, f"must be <= {meta['hi']}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def _resolve_batch(cfg: ZeroCacheConfig, dp: int) -> None:
    """Fill the batch triple so that train_batch_size = micro * gas * dp (DeepSpeed's rules)."""
    tbs, mbs, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            raise ZeroConfigError(
                f"zero_cache config: train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({mbs})"
                f" * gradient_accumulation_steps ({gas}) * data-parallel size ({dp}) = {mbs * gas * dp}; "
                f"fix one of them or omit one and let it be derived")
    elif tbs is not None and mbs is not None:
        if tbs % (mbs * dp):
            raise ZeroConfigError(
                f"zero_cache config: train_batch_size ({tbs}) is not divisible by train_micro_batch_size_per_gpu"
                f" ({mbs}) * data-parallel size ({dp}); choose sizes that divide")
        gas = tbs // (mbs * dp)
    elif tbs is not None and gas is not None:
        if tbs % (gas * dp):
            raise ZeroConfigError(
                f"zero_cache config: train_batch_size ({tbs}) is not divisible by gradient_accumulation_steps"
                f" ({gas}) * data-parallel size ({dp}); choose sizes that divide")
        mbs = tbs // (gas * dp)
    elif tbs is not None:
        if tbs % dp:
            raise ZeroConfigError(f"zero_cache config: train_batch_size ({tbs}) is not divisible by the "
                              f"data-parallel size ({dp})")
        mbs, gas = tbs // dp, 1
    else:
        mbs, gas = mbs or 1, gas or 1
    cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = mbs, gas
    cfg.train_batch_size = mbs * gas * dp


def _validate(cfg: ZeroCacheConfig) -> None:
    z = cfg.zero_optimization
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ZeroConfigError("zero_cache config: 'fp16.enabled' and 'bf16.enabled' are both true; enable at most one")
    if z.offload_param.device != "none" and z.stage != 3:
        raise ZeroConfigError("zero_cache config: 'zero_optimization.offload_param' needs stage 3 (parameters are only "
                          f"partitioned in stage 3, got stage {z.stage}); set stage 3 or remove offload_param")
    fp32 = not (cfg.fp16.enabled or cfg.bf16.enabled)
    if fp32 and z.offload_param.device == "cpu" and z.offload_optimizer.device == "none":
        raise ZeroConfigError("zero_cache config: in fp32 the parameter shard is the optimizer's master copy, so "
                          "'offload_param.device' = 'cpu' needs 'offload_optimizer.device' = 'cpu' or 'nvme' too")
    if fp32 and z.offload_param.device == "nvme" and z.offload_optimizer.device != "nvme":
        raise ZeroConfigError("zero_cache config: in fp32 the parameter shard is the optimizer's master copy, so "
                          "'offload_param.device' = 'nvme' needs 'offload_optimizer.device' = 'nvme' too")
    if z.offload_param.device == "nvme" and z.offload_optimizer.device == "nvme" and \
            os.path.normpath(z.offload_param.nvme_path) != os.path.normpath(z.offload_optimizer.nvme_path):
        raise ZeroConfigError(f"zero_cache config: 'offload_param.nvme_path' ({z.offload_param.nvme_path}) and "
                          f"'offload_optimizer.nvme_path' ({z.offload_optimizer.nvme_path}) differ; the SSD tier "
                          f"uses one directory per rank, set both to the same path")
    if z.lock_free_update and z.offload_optimizer.device == "none":
        raise ZeroConfigError("zero_cache config: 'zero_optimization.lock_free_update' overlaps the offloaded "
                              "optimizer step with the next step's compute; it needs 'offload_optimizer.device' = "
                              "'cpu' or 'nvme'")
    b1, b2 = cfg.optimizer.params.betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ZeroConfigError(f"zero_cache config: 'optimizer.params.betas' must be in [0, 1), got {[b1, b2]}")


def parse_config(config: dict | str | os.PathLike | ZeroCacheConfig, dp_world_size: int = 1) -> ZeroCacheConfig:
    """Parse a dict, a JSON file path or an already-built config; resolve batch sizes against ``dp_world_size``."""
    if isinstance(config, ZeroCacheConfig):
        cfg = dataclasses.replace(config)
    else:
        if isinstance(config, (str, os.PathLike)):
            if not os.path.isfile(config):
                raise ZeroConfigError(f"zero_cache config: file '{config}' does not exist; pass a dict or a JSON path")
            with open(config, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ZeroConfigError(f"zero_cache config: '{f.name}' is not valid JSON: {e}") from None
        cfg = _build(ZeroCacheConfig, config, "")
    _validate(cfg)
    _resolve_batch(cfg, dp_world_size)
    return cfg
