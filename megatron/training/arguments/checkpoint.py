"""Checkpoint save/load flags -> ``CheckpointConfig``; ``--use-checkpoint-args`` fills the model flags."""
from __future__ import annotations

import argparse

from megatron.training.checkpoint.config import CKPT_FORMATS, CheckpointConfig
from megatron.training.checkpoint.saved_args import saved_args

# The model's shape and design, taken from the checkpoint over the command line (Megatron's forced ones).
_MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "group_query_attention", "kv_channels", "seq_length", "max_position_embeddings",
               "position_embedding_type", "rotary_base", "normalization", "swiglu", "openai_gelu",
               "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "add_qkv_bias",
               "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
               "moe_shared_expert_gate", "moe_router_score_function", "moe_router_pre_softmax",
               "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias")
# Taken only when the command line leaves them out (as Megatron does for the tokenizer).
_TOKENIZER_ARGS = ("tokenizer_type", "vocab_size")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="directory to save checkpoints to")
    g.add_argument("--load", type=str, default=None, help="directory to load the latest checkpoint from")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoint saves")
    g.add_argument("--no-save-optim", action="store_true", help="do not save optimizer and scheduler state")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer and scheduler state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; start at iteration 0 with fresh optimizer, scheduler and RNG")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
                   help="torch_dist: the distributed checkpoint, which any mesh and ZeRO placement loads; torch: the "
                        "per-rank legacy layout (same mesh only). Loading reads either")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training continues (torch_dist)")
    g.add_argument("--save-interval-minutes", type=float, default=None,
                   help="also save when this many minutes passed since the last save (preemptible clusters)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between snapshots in host memory (with --non-persistent-ckpt-type local)")
    g.add_argument("--non-persistent-ckpt-type", choices=("global", "local", "in_memory"), default=None,
                   help="local: snapshots in each host's memory under --non-persistent-local-ckpt-dir, restored "
                        "before --load when newer (the only kind built here)")
    g.add_argument("--non-persistent-local-ckpt-dir", type=str, default=None,
                   help="where each host keeps its snapshots: a memory filesystem such as /dev/shm/ptm")
    g.add_argument("--non-persistent-local-ckpt-algo", choices=("fully_parallel", "atomic"), default=None,
                   help="accepted for Megatron's scripts; every rank writes its part in parallel here")
    g.add_argument("--replication", action="store_true",
                   help="also copy each rank's snapshot into the memory of a rank on another host")
    g.add_argument("--replication-jump", type=int, default=None,
                   help="the copy goes to the rank this many ranks on (default: ranks per host, the next host)")
    g.add_argument("--replication-factor", type=int, default=2, help="copies of each snapshot file (2 here)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape from the checkpoint under --load (over the model flags), and its "
                        "tokenizer unless given")
    return parser


def apply_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: the checkpoint's model arguments into ``args``; without a checkpoint under --load
    the flags stay as given (as in Megatron)."""
    if not args.use_checkpoint_args:
        return
    if not args.load:
        raise ValueError("--use-checkpoint-args needs --load DIR (the checkpoint to read the arguments from)")
    saved = saved_args(args.load)
    if saved is None:
        return
    for key in _MODEL_ARGS:
        if key in saved:
            setattr(args, key, saved[key])
    if saved.get("num_experts") is not None:  # stored as one int; the flag takes Megatron-DeepSpeed's list form
        args.num_experts = [saved["num_experts"]]
    if "add_bias_linear" in saved:
        args.disable_bias_linear = not saved["add_bias_linear"]
    if "layernorm_epsilon" in saved:
        args.norm_epsilon = saved["layernorm_epsilon"]
    args.use_rotary_position_embeddings = False  # the checkpoint's position_embedding_type decides
    for key in _TOKENIZER_ARGS:
        if getattr(args, key) is None and saved.get(key) is not None:
            setattr(args, key, saved[key])


def checkpoint_config_from_args(args: argparse.Namespace) -> CheckpointConfig:
    return CheckpointConfig(save=args.save, load=args.load, save_interval=args.save_interval,
                            no_save_optim=args.no_save_optim, no_load_optim=args.no_load_optim,
                            no_load_rng=args.no_load_rng, finetune=args.finetune, ckpt_format=args.ckpt_format,
                            async_save=args.async_save, save_interval_minutes=args.save_interval_minutes,
                            non_persistent_save_interval=args.non_persistent_save_interval,
                            non_persistent_ckpt_type=args.non_persistent_ckpt_type,
                            non_persistent_local_ckpt_dir=args.non_persistent_local_ckpt_dir,
                            replication=args.replication, replication_jump=args.replication_jump,
                            replication_factor=args.replication_factor)
