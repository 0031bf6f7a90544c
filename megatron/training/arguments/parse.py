"""``parse_args``: the command line -> one frozen ``Config``, validated before anything starts.

Each flag group (a module of this package) maps its flags to its config; this module composes them,
checks what spans groups (the model on the mesh, the training data, ``--deepspeed`` with the schedule
and its JSON against the flags) and reports bad input as one ``ConfigError`` line.
"""
from __future__ import annotations

import argparse
import os

from megatron.training.arguments.checkpoint import add_checkpoint_args, checkpoint_config_from_args
from megatron.training.arguments.data import add_data_args, data_config_from_args
from megatron.training.arguments.deepspeed import add_deepspeed_args, deepspeed_flags_from_args
from megatron.training.arguments.model import add_model_args, model_config_from_args
from megatron.training.arguments.optimizer import add_optimizer_args, optimizer_config_from_args
from megatron.training.arguments.parallel import add_parallel_args, parallel_config_from_args
from megatron.training.arguments.scheduler import add_scheduler_args, scheduler_config_from_args
from megatron.training.arguments.tokenizer import add_tokenizer_args, tokenizer_config_from_args
from megatron.training.arguments.train import add_training_args, train_config_from_args
from megatron.training.config import Config, ConfigError, FlagValue, ModelConfig, ParallelConfig
from megatron.training.zero_config import zero_cache_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pre-train a GPT model (Megatron-LM flags).", allow_abbrev=False)
    add_model_args(p)
    add_parallel_args(p)
    add_training_args(p)
    add_deepspeed_args(p)
    add_optimizer_args(p)
    add_scheduler_args(p)
    add_checkpoint_args(p)
    add_data_args(p)
    add_tokenizer_args(p)
    return p


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Parse and validate; raise ConfigError (one line) on bad input. ``world_size`` defaults to $WORLD_SIZE."""
    args = build_parser().parse_args(argv)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return _config(args, world_size)
    except ValueError as e:  # every config reports bad values as ValueError, naming the flag
        raise ConfigError(str(e)) from None


def _config(args: argparse.Namespace, world_size: int) -> Config:
    model = model_config_from_args(args)
    parallel = parallel_config_from_args(args, world_size)
    train = train_config_from_args(args)
    _check_model_on_mesh(model, parallel)
    deepspeed = deepspeed_flags_from_args(args)
    if deepspeed.enabled and (args.start_weight_decay is not None or args.end_weight_decay is not None):
        raise ValueError("--start-weight-decay/--end-weight-decay are not supported with --deepspeed "
                         "(the engine uses a constant --weight-decay); drop them")
    if not args.mock_data and not (args.data_path or args.train_data_path):
        raise ValueError("no training data: pass --data-path PREFIX (see tools/preprocess_data.py) "
                         "or --mock-data for synthetic tokens")
    optimizer = optimizer_config_from_args(args)
    scheduler = scheduler_config_from_args(args, train.train_iters)
    data = data_config_from_args(args, build_timeout_minutes=parallel.distributed_timeout_minutes)
    tokenizer, checkpoint = tokenizer_config_from_args(args), checkpoint_config_from_args(args)
    # The JSON last, once every flag it is merged with is valid (the data-parallel size included).
    zero = zero_cache_config(deepspeed, parallel, optimizer) if deepspeed.enabled else None
    return Config(model=model, parallel=parallel, train=train, optimizer=optimizer, scheduler=scheduler, data=data,
                  tokenizer=tokenizer, checkpoint=checkpoint, deepspeed=deepspeed, zero_cache=zero,
                  flags=_flags(args, model, parallel))


def _check_model_on_mesh(model: ModelConfig, parallel: ParallelConfig) -> None:
    pp, tp = parallel.pipeline_model_parallel_size, parallel.tensor_model_parallel_size
    if model.num_layers % pp:
        raise ValueError(f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    heads_groups = model.num_query_groups or model.num_attention_heads
    if heads_groups % tp:
        raise ValueError(f"the number of query groups / attention heads ({heads_groups}) is not divisible by "
                         f"--tensor-model-parallel-size {tp}")


def _flags(args: argparse.Namespace, model: ModelConfig, parallel: ParallelConfig) -> tuple[tuple[str, FlagValue], ...]:
    """The scalar flags by Megatron name, with the values the configs resolved (checkpoints store them)."""
    resolved = dict(vars(args), recompute_granularity=model.recompute_granularity, params_dtype=model.precision,
                    data_parallel_size=parallel.data_parallel_size, global_batch_size=parallel.global_batch_size,
                    group_query_attention=args.group_query_attention or args.num_query_groups is not None)
    return tuple((k, v) for k, v in resolved.items() if isinstance(v, (int, float, str, bool, type(None))))
