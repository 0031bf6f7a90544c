"""``parse_args``: the command line -> one frozen ``Config``, validated before anything starts.

Each flag group (a module of this package) maps its flags to its config; this module composes them,
checks what spans groups (the model on the mesh, the training data, the zero_cache engine with the schedule
and its JSON against the flags) and reports bad input as one ``ConfigError`` line (parser.py: unknown flags
and malformed values too).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from megatron.core.transformer_config import CP_COMM_TYPES_WITHOUT_DROPOUT
from megatron.training.arguments.checkpoint import (
    add_checkpoint_args,
    apply_checkpoint_args,
    checkpoint_config_from_args,
)
from megatron.training.arguments.compat import add_compat_args, check_compat
from megatron.training.arguments.data import add_data_args, data_config_from_args
from megatron.training.arguments.deepspeed import add_deepspeed_args, deepspeed_flags_from_args
from megatron.training.arguments.model import add_model_args, model_config_from_args
from megatron.training.arguments.moe import add_moe_args
from megatron.training.arguments.optimizer import add_optimizer_args, optimizer_config_from_args
from megatron.training.arguments.parallel import add_parallel_args, parallel_config_from_args
from megatron.training.arguments.parser import TrainerArgumentParser
from megatron.training.arguments.scheduler import add_scheduler_args, scheduler_config_from_args
from megatron.training.arguments.tokenizer import add_tokenizer_args, tokenizer_config_from_args
from megatron.training.arguments.train import (
    add_training_args,
    housekeeping_config_from_args,
    log_config_from_args,
    straggler_config_from_args,
    train_config_from_args,
    train_iters_from_args,
    train_samples_from_args,
)
from megatron.training.config import Config, ConfigError, FlagValue, ModelConfig, ParallelConfig
from megatron.training.zero_config import zero_cache_config


def build_parser() -> argparse.ArgumentParser:
    p = TrainerArgumentParser(description="Pre-train a GPT model (Megatron-LM flags; docs/training.md, "
                                          "docs/megatron-compat.md).")
    add_model_args(p)
    add_moe_args(p)
    add_parallel_args(p)
    add_training_args(p)
    add_deepspeed_args(p)
    add_optimizer_args(p)
    add_scheduler_args(p)
    add_checkpoint_args(p)
    add_data_args(p)
    add_tokenizer_args(p)
    add_compat_args(p)
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
    check_compat(args)
    apply_checkpoint_args(args)
    model = model_config_from_args(args)  # first: the batch schedule reads --seq-length
    parallel = parallel_config_from_args(args, world_size)
    schedule = parallel.schedule
    train_iters = train_iters_from_args(args, schedule)
    train = train_config_from_args(args, train_iters)
    _check_model_on_mesh(model, parallel)
    model = _resolve_offloaded_layers(model, parallel)
    deepspeed = deepspeed_flags_from_args(args)
    if not args.mock_data and not (args.data_path or args.train_data_path):
        raise ValueError("no training data: pass --data-path PREFIX (see tools/preprocess_data.py) "
                         "or --mock-data for synthetic tokens")
    optimizer = optimizer_config_from_args(args)
    scheduler = scheduler_config_from_args(args, train_samples_from_args(args, train_iters, parallel.global_batch_size),
                                           parallel.global_batch_size, model.seq_length)
    data = data_config_from_args(args, build_timeout_minutes=parallel.distributed_timeout_minutes)
    tokenizer, checkpoint = tokenizer_config_from_args(args), checkpoint_config_from_args(args)
    log, housekeeping = log_config_from_args(args), housekeeping_config_from_args(args)
    if parallel.context_parallel_size > 1 and data.reset_attention_mask:
        raise ValueError("--reset-attention-mask with --context-parallel-size > 1: context-parallel attention is "
                         "causal over the whole sequence only; drop --reset-attention-mask")
    if parallel.expert_model_parallel_size > 1 and checkpoint.ckpt_format == "torch":
        raise ValueError("--ckpt-format torch with --expert-model-parallel-size > 1: the legacy per-rank layout has "
                         "no place for expert-parallel shards; use --ckpt-format torch_dist (the default), which "
                         "also reshards experts to another EP size on load")
    # The JSON last, once every flag it is merged with is valid (the data-parallel size included).
    zero = zero_cache_config(deepspeed, parallel, optimizer)
    if zero is not None:
        _check_engine(args, parallel)
    if parallel.pipeline_schedule == "zb-h1":
        _check_split_backward(model, zero is not None)
    return Config(model=model, parallel=parallel, train=train, optimizer=optimizer, scheduler=scheduler, data=data,
                  tokenizer=tokenizer, checkpoint=checkpoint, deepspeed=deepspeed, log=log, housekeeping=housekeeping,
                  stragglers=straggler_config_from_args(args), zero_cache=zero,
                  flags=_flags(args, model, parallel, train_iters))


def _check_engine(args: argparse.Namespace, parallel: ParallelConfig) -> None:
    """What the zero_cache engine (--deepspeed with ZeRO stage >= 1, --use-distributed-optimizer) cannot do."""
    how = "--deepspeed" if args.deepspeed else "--use-distributed-optimizer"
    if args.start_weight_decay is not None or args.end_weight_decay is not None:
        raise ValueError(f"--start-weight-decay/--end-weight-decay are not supported with {how} "
                         "(the engine uses a constant --weight-decay); drop them")
    if parallel.batch_schedule is not None:
        raise ValueError(f"--rampup-batch-size / --step-batch-size-schedule with {how}: the engine's gradient "
                         "accumulation is fixed at start-up; drop the schedule, or train without the engine (no "
                         f"{how}, or ZeRO stage 0)")


def _check_split_backward(model: ModelConfig, engine: bool) -> None:
    """ZB-H1 keeps the weight gradients of the linear and embedding layers, which write their own, for later."""
    if not engine:
        raise ValueError("--pipeline-schedule zb-h1 (--enable-zero-bubble) computes weight gradients apart from the "
                         "backward, which the zero_cache engine does: add --use-distributed-optimizer or --deepspeed "
                         "with a ZeRO stage >= 1")
    if not model.gradient_accumulation_fusion:
        raise ValueError("--pipeline-schedule zb-h1 (--enable-zero-bubble) with --no-gradient-accumulation-fusion: "
                         "the split backward defers the weight gradients the layers write themselves; drop the flag")


def _check_sequence_split(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Context parallelism cuts every sequence into 2 x CP chunks; sequence parallelism cuts a rank's part of it
    into TP pieces; the all-to-all variant also splits the heads of each tensor-parallel rank."""
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    sp = parallel.sequence_parallel
    if cp == 1 and not sp:
        return
    if model.moe is not None:
        what = "--context-parallel-size > 1" if cp > 1 else "--sequence-parallel"
        raise ValueError(f"{what} with mixture-of-experts layers (--num-experts) is not supported here; drop one")
    pieces = 2 * cp * (tp if sp else 1) if cp > 1 else tp
    if model.seq_length % pieces:
        split = " x ".join(([f"2 x --context-parallel-size {cp}"] if cp > 1 else [])
                           + ([f"--tensor-model-parallel-size {tp} (--sequence-parallel)"] if sp else []))
        raise ValueError(f"--seq-length {model.seq_length} is not divisible by {split} = {pieces}; use a multiple "
                         f"of {pieces}")
    if cp == 1:
        return
    if parallel.cp_comm_type in CP_COMM_TYPES_WITHOUT_DROPOUT and model.attention_dropout > 0:
        raise ValueError(f"--attention-dropout {model.attention_dropout} with --cp-comm-type "
                         f"{parallel.cp_comm_type} (its block kernels take no dropout): set --attention-dropout 0, "
                         "or use --cp-comm-type a2a")
    if parallel.cp_comm_type == "a2a" and (model.num_attention_heads // tp) % cp:
        raise ValueError(f"--cp-comm-type a2a splits each tensor-parallel rank's {model.num_attention_heads // tp} "
                         f"attention heads over --context-parallel-size {cp}: choose sizes that divide, or use "
                         "--cp-comm-type p2p or allgather")


def _resolve_offloaded_layers(model: ModelConfig, parallel: ParallelConfig) -> ModelConfig:
    """--cpu-offloading's layer count against the layers of one model chunk (all but the last by default)."""
    requested = model.cpu_offloading_num_layers
    if requested == 0:
        return model
    chunk = model.num_layers // (parallel.pipeline_model_parallel_size * parallel.virtual_stages)
    n = chunk - 1 if requested == -1 else requested
    if not 1 <= n < chunk:
        flag = "--cpu-offloading" if requested == -1 else f"--cpu-offloading-num-layers {requested}"
        raise ValueError(f"{flag}: a model chunk here has {chunk} layer(s) and the last one's activations are needed "
                         f"first by the backward, so 1 to {chunk - 1} layers can be offloaded; use more layers per "
                         "stage or drop --cpu-offloading")
    return dataclasses.replace(model, cpu_offloading_num_layers=n)


def _check_model_on_mesh(model: ModelConfig, parallel: ParallelConfig) -> None:
    pp, tp = parallel.pipeline_model_parallel_size, parallel.tensor_model_parallel_size
    if model.num_layers % (pp * parallel.virtual_stages):
        what = f"--pipeline-model-parallel-size {pp}" + (
            f" x {parallel.virtual_stages} virtual stages" if parallel.virtual_stages > 1 else "")
        raise ValueError(f"--num-layers {model.num_layers} is not divisible by {what}")
    heads_groups = model.num_query_groups or model.num_attention_heads
    if heads_groups % tp:
        raise ValueError(f"the number of query groups / attention heads ({heads_groups}) is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    _check_sequence_split(model, parallel)
    ep = parallel.expert_model_parallel_size
    if model.moe is None:
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} without --num-experts: a dense model has no experts "
                             "to split; drop it or add --num-experts")
        return
    if model.moe.num_experts % ep:
        raise ValueError(f"--num-experts {model.moe.num_experts} is not divisible by --expert-model-parallel-size "
                         f"{ep}; choose an expert count the expert-parallel ranks split evenly")
    ffn = model.moe.expert_ffn_hidden_size(model.ffn_hidden_size or 4 * model.hidden_size)
    if ffn % tp:
        raise ValueError(f"the experts' width {ffn} (--moe-ffn-hidden-size) is not divisible by "
                         f"--tensor-model-parallel-size {tp}")


def _flags(args: argparse.Namespace, model: ModelConfig, parallel: ParallelConfig,
           train_iters: int) -> tuple[tuple[str, FlagValue], ...]:
    """The scalar flags by Megatron name, with the values the configs resolved (checkpoints store them)."""
    resolved = dict(vars(args), recompute_granularity=model.recompute_granularity, params_dtype=model.precision,
                    data_parallel_size=parallel.data_parallel_size, global_batch_size=parallel.global_batch_size,
                    train_iters=train_iters, attention_backend=model.attention_backend,
                    num_experts=model.moe.num_experts if model.moe is not None else None,
                    group_query_attention=args.group_query_attention or args.num_query_groups is not None)
    return tuple((k, v) for k, v in resolved.items()
                 if not k.startswith("compat_") and isinstance(v, (int, float, str, bool, type(None))))
