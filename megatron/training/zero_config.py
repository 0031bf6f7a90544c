"""The zero_cache engine's config: ``--deepspeed_config``'s DeepSpeed-style JSON merged with the Megatron flags, or
ZeRO-1 for ``--use-distributed-optimizer``; parsed once into a typed ``ZeroCacheConfig`` (by ``parse_args``, where
the data-parallel size is known; the ZeRO backend hands the result to ``zero_cache.initialize``).

The flags fill in, and must agree with, the JSON's batch, precision, clipping and optimizer keys; a key
that disagrees is one ``ConfigError`` line, as is every error of the engine's own parsing (a
``ZeroConfigError``, which ``parse_args`` reports the same way). ZeRO stage 0 (DeepSpeed's "no ZeRO") is
Megatron DDP: no engine config.
"""
from __future__ import annotations

import json
import math

from megatron.core.optimizer.config import OptimizerConfig
from megatron.training.config import ConfigError, DeepSpeedFlags, ParallelConfig
from zero_cache.config import ZeroCacheConfig, parse_config, read_json


def _agree(ds: dict, key: str, value, flag: str, where: str = "") -> None:
    """Fill ``ds[key]`` from a Megatron flag, or check the JSON says the same (``where``: the enclosing
    block's path, for the message). ``true`` is not 1 here: a bool only agrees with a bool."""
    if key in ds and (ds[key] != value or isinstance(ds[key], bool) != isinstance(value, bool)):
        raise ConfigError(f"deepspeed config '{where}{key}': {json.dumps(ds[key])} disagrees with {flag} "
                          f"({value}); remove the key or make them equal")
    ds[key] = value


def _block(ds: dict, key: str, path: str) -> dict:
    """``ds[key]``, created empty when missing; a JSON object or a ConfigError naming the file."""
    block = ds.setdefault(key, {})
    if not isinstance(block, dict):
        raise ConfigError(f"deepspeed config '{key}' in {path} must be a JSON object, got {json.dumps(block)}")
    return block


def _trainer_keys(ds: dict, path: str) -> None:
    """Megatron-DeepSpeed's example JSONs carry keys read by its trainer, not by DeepSpeed's engine."""
    ds.pop("prescale_gradients", None)  # divide before or after the gradient reduction: the same average
    curriculum = ds.pop("curriculum_learning", None)
    if isinstance(curriculum, dict) and curriculum.get("enabled"):
        raise ConfigError(f"deepspeed config 'curriculum_learning' in {path} is enabled: curriculum learning is not "
                          "implemented here; set its enabled to false or remove the block")


def merged_json(ds: dict, path: str, zero_stage: int | None, par: ParallelConfig, o: OptimizerConfig) -> dict:
    """The JSON object ``ds`` (from ``path``) with --zero-stage and the flags' batch, precision, clipping and
    optimizer filled in."""
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed_config {path} must hold a JSON object ({{...}}), got {type(ds).__name__}")
    _trainer_keys(ds, path)
    _agree(ds, "train_micro_batch_size_per_gpu", par.micro_batch_size, "--micro-batch-size")
    _agree(ds, "gradient_accumulation_steps", par.num_microbatches,
           "--global-batch-size / (--micro-batch-size x data-parallel size)")
    _agree(ds, "train_batch_size", par.global_batch_size, "--global-batch-size")
    if zero_stage is not None:
        _block(ds, "zero_optimization", path)["stage"] = zero_stage
    for key, on in (("bf16", o.bf16), ("fp16", o.fp16)):
        block = _block(ds, key, path)
        if "enabled" in block and not isinstance(block["enabled"], bool):
            raise ConfigError(f"deepspeed config '{key}.enabled' in {path} must be true or false, got "
                              f"{json.dumps(block['enabled'])}")
        if "enabled" in block and block["enabled"] != on:
            raise ConfigError(f"deepspeed config '{key}.enabled' is {json.dumps(block['enabled'])} but --{key} is "
                              f"{'set' if on else 'not set'}; make them agree")
        block["enabled"] = on
    if o.fp16 and "loss_scale" not in ds["fp16"]:
        ds["fp16"].update(loss_scale=o.loss_scale or 0.0, loss_scale_window=o.loss_scale_window,
                          hysteresis=o.hysteresis, min_loss_scale=o.min_loss_scale,
                          initial_scale_power=int(round(math.log2(o.initial_loss_scale))))
    # The flags' optimizer is the one that trains (as a client optimizer wins over the JSON's in DeepSpeed):
    # a JSON block that says otherwise is an error, not a silent override in either direction.
    _agree(ds, "gradient_clipping", o.clip_grad, "--clip-grad")
    opt = ds.setdefault("optimizer", {"type": "AdamW"})
    params = opt.setdefault("params", {}) if isinstance(opt, dict) else None
    if not isinstance(params, dict):
        raise ConfigError(f"deepspeed config 'optimizer' in {path} must be an object whose 'params' is an object; "
                          f"remove the block to train with the flags' AdamW")
    for key, value, flag in (("lr", o.lr, "--lr"), ("betas", [o.adam_beta1, o.adam_beta2], "--adam-beta1/2"),
                             ("eps", o.adam_eps, "--adam-eps"), ("weight_decay", o.weight_decay, "--weight-decay")):
        _agree(params, key, value, flag, "optimizer.params.")
    if opt.get("type") == "Adam" and params.get("adam_w_mode") is False:
        raise ConfigError("deepspeed config 'optimizer': type Adam with adam_w_mode false adds weight decay to the "
                          "gradient (L2), but the trainer's Adam decays decoupled (AdamW); remove the block or "
                          "set type AdamW")
    return ds


def zero_cache_config(flags: DeepSpeedFlags, par: ParallelConfig, o: OptimizerConfig) -> ZeroCacheConfig | None:
    """The engine's config of this run, its batch sizes resolved against the data-parallel size; None for
    Megatron DDP (no --deepspeed nor --use-distributed-optimizer, or ZeRO stage 0)."""
    if flags.enabled:
        ds = merged_json(read_json(flags.config_path), flags.config_path, flags.zero_stage, par, o)
        stage = _block(ds, "zero_optimization", flags.config_path).get("stage")
        if stage == 0:
            if flags.distributed_optimizer:
                raise ConfigError("--use-distributed-optimizer with ZeRO stage 0 (no sharding) in --deepspeed_config / "
                                  "--zero-stage: drop the flag or use stage 1 or more")
            return None  # DeepSpeed's stage 0 shards nothing: Megatron DDP does exactly that
    elif flags.distributed_optimizer:
        ds = merged_json({"zero_optimization": {"stage": 1}}, "--use-distributed-optimizer", None, par, o)
    else:
        return None
    # In the engine's terms a micro-batch is one backward pass over this rank's model: it shards over data x
    # context parallelism (context-parallel ranks hold the same weights, each trains its part of the batch), and
    # under the interleaved schedule each of a stage's v model chunks runs its own backward per micro-batch (the
    # schedule tells the engine which pass is the step's last: backends/zero.py).
    cp, v = par.context_parallel_size, par.virtual_stages
    ds["gradient_accumulation_steps"] = par.num_microbatches * v
    ds["train_batch_size"] = par.global_batch_size * cp * v
    return parse_config(ds, par.data_parallel_size * cp)
