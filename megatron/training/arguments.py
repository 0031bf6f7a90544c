"""Command line -> typed configuration, built once and passed explicitly.

Flag names are Megatron-LM's. Each subsystem owns its flags (``add_*_args``)
and its config dataclass; this module composes them, checks cross-cutting
constraints (mesh, batch sizes) and reports bad input as one clear line.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron.core.optimizer.config import OptimizerConfig, add_optimizer_args, optimizer_config_from_args
from megatron.core.parallel_state import ParallelConfigError, mesh_sizes
from megatron.core.transformer_config import TransformerConfig
from megatron.data import DataConfig, add_data_args, data_config_from_args
from megatron.tokenizer import TokenizerConfig, add_tokenizer_args, tokenizer_config_from_args
from megatron.training.checkpointing import CheckpointConfig, add_checkpoint_args, checkpoint_config_from_args
from megatron.training.lr_scheduler import add_scheduler_args


class ConfigError(ValueError):
    """Bad command line: printed as one line, exit code 2."""


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    distributed_backend: str
    distributed_timeout_minutes: float

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class TrainConfig:
    train_iters: int
    eval_interval: int
    eval_iters: int
    log_interval: int
    tensorboard_dir: str | None
    seed: int
    exit_interval: int | None


@dataclass(frozen=True)
class ZeroConfigArgs:
    """``--deepspeed`` routes the model through the zero_cache engine with this JSON config."""
    enabled: bool
    config_path: str | None
    zero_stage: int | None


@dataclass(frozen=True)
class Config:
    args: argparse.Namespace  # the raw flags: model shape (built after the tokenizer) and checkpoint 'args'
    parallel: ParallelConfig
    train: TrainConfig
    optimizer: OptimizerConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    zero: ZeroConfigArgs


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g = p.add_argument_group("precision and recompute")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--checkpoint-activations", action="store_true", help="legacy alias of --recompute-granularity full")


def _add_parallel_and_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("zero_cache (DeepSpeed-style)")
    g.add_argument("--deepspeed", action="store_true", help="train through the zero_cache engine")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="overrides zero_optimization.stage of the config")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pre-train a GPT model (Megatron-LM flags).", allow_abbrev=False)
    _add_model_args(p)
    _add_parallel_and_training_args(p)
    add_optimizer_args(p)
    add_scheduler_args(p)
    add_checkpoint_args(p)
    add_data_args(p)
    add_tokenizer_args(p)
    return p


def _validate(args: argparse.Namespace, world_size: int) -> None:
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive; pick one")
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
    args.params_dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    for name in ("micro_batch_size", "train_iters", "log_interval", "eval_interval", "num_layers", "hidden_size",
                 "num_attention_heads", "seq_length"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(args, name)})")
    try:
        dp = mesh_sizes(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    except ParallelConfigError as e:
        raise ConfigError(str(e)) from None
    args.data_parallel_size = dp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {args.micro_batch_size * dp}; "
            f"use a multiple of {args.micro_batch_size * dp}")
    if args.num_layers % args.pipeline_model_parallel_size:
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
                          f"{args.pipeline_model_parallel_size}")
    if args.num_query_groups is not None and not args.group_query_attention:
        args.group_query_attention = True
    heads_groups = args.num_query_groups or args.num_attention_heads
    if heads_groups % args.tensor_model_parallel_size:
        raise ConfigError(f"the number of query groups / attention heads ({heads_groups}) is not divisible by "
                          f"--tensor-model-parallel-size {args.tensor_model_parallel_size}")
    if args.deepspeed and not args.deepspeed_config:
        raise ConfigError("--deepspeed needs --deepspeed_config FILE (a DeepSpeed-style JSON)")
    if args.deepspeed_config and not os.path.isfile(args.deepspeed_config):
        raise ConfigError(f"--deepspeed_config {args.deepspeed_config}: no such file")
    if not args.mock_data and not (args.data_path or args.train_data_path):
        raise ConfigError("no training data: pass --data-path PREFIX (see tools/preprocess_data.py) "
                          "or --mock-data for synthetic tokens")


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Parse and validate; raise ConfigError (one line) on bad input."""
    args = build_parser().parse_args(argv)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    _validate(args, world_size)
    try:
        optimizer = optimizer_config_from_args(args)
        data = data_config_from_args(args)
        tokenizer = tokenizer_config_from_args(args)
        checkpoint = checkpoint_config_from_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Config(
        args=args,
        parallel=ParallelConfig(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                args.data_parallel_size, args.micro_batch_size, args.global_batch_size,
                                args.distributed_backend, args.distributed_timeout_minutes),
        train=TrainConfig(args.train_iters, args.eval_interval, args.eval_iters, args.log_interval,
                          args.tensorboard_dir, args.seed, args.exit_interval),
        optimizer=optimizer, data=data, tokenizer=tokenizer, checkpoint=checkpoint,
        zero=ZeroConfigArgs(args.deepspeed, args.deepspeed_config, args.zero_stage),
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Pad the vocabulary so every tensor-parallel shard of the embedding has the same, aligned size."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def transformer_config_from_args(args: argparse.Namespace, vocab_size: int) -> TransformerConfig:
    try:
        return TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
            kv_channels=args.kv_channels, seq_length=args.seq_length,
            max_position_embeddings=args.max_position_embeddings,
            padded_vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by,
                                                args.tensor_model_parallel_size),
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
            add_bias_linear=not args.disable_bias_linear,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            init_method_std=args.init_method_std, precision=args.params_dtype,
            recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers, seed=args.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
