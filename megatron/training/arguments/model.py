"""Model shape, precision and activation-recompute flags -> ``ModelConfig``."""
from __future__ import annotations

import argparse

from megatron.training.arguments.moe import moe_config_from_args
from megatron.training.attention_backend import ATTENTION_BACKENDS
from megatron.training.config import ModelConfig

# Without them there is no model; --use-checkpoint-args may take them from the checkpoint instead.
REQUIRED_MODEL_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
_REQUIRED_HELP = "required, unless --use-checkpoint-args reads it from the checkpoint under --load"
_NORMALIZATIONS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


def _normalization(text: str) -> str:
    """Megatron-LM spells LayerNorm / RMSNorm, Megatron-DeepSpeed layernorm / rmsnorm."""
    return _NORMALIZATIONS.get(text.lower(), text)


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--hidden-size", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x --hidden-size")
    g.add_argument("--num-attention-heads", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", "--num-key-value-heads", dest="num_query_groups", type=int, default=None,
                   help="grouped-query attention: key/value heads (default: one per attention head)")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-DeepSpeed's spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", "--rotary-position-embeddings-theta", dest="rotary_base", type=float,
                   default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="1.0 only: every channel of a head is rotated (partial rotary is not implemented)")
    g.add_argument("--normalization", type=_normalization, choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="Megatron's zero-centred norm weights (1 + w): the same function and, as norm weights get "
                        "no weight decay, the same training; the weights are stored as 1 + w")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true", help="GELU's tanh approximation (GPT-2's gelu_new)")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true", help="biases on the QKV projection even with "
                   "--disable-bias-linear (Qwen2)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="torch scaled_dot_product_attention's kernel: auto (torch picks), flash, fused (cuDNN or "
                        "memory-efficient), unfused / local (the math kernel)")
    g.add_argument("--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
                   dest="use_flash_attn", action="store_true",
                   help="Megatron-DeepSpeed's spelling of --attention-backend flash")
    g = parser.add_argument_group("precision and recompute")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: recompute each layer's activations in backward; selective: recompute only the "
                        "attention core (softmax(QK^T)V) and keep the linear layers' inputs")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--checkpoint-activations", action="store_true", help="legacy alias of --recompute-granularity full")
    g.add_argument("--cpu-offloading", action="store_true",
                   help="move the activations saved in the forward of the first --cpu-offloading-num-layers "
                        "layers of each model chunk to host memory on the copy streams, and back before backward")
    g.add_argument("--cpu-offloading-num-layers", type=int, default=None,
                   help="layers per model chunk whose activations --cpu-offloading moves (fewer than the chunk's "
                        "layers: the last one's backward comes first; default all but that last one)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each dense transformer layer (torchtitan's per-block compile; mixture-of-"
                        "experts layers stay eager). The ZeRO-3 gathers and the engine's hooks stay outside the "
                        "compiled layers, which return their weight gradients through autograd (no gradient-"
                        "accumulation fusion inside them)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="linear and embedding layers return their weight gradients through autograd instead of "
                        "adding them into the gradient buffers themselves (main_grad, or the ZeRO engine's with "
                        "--deepspeed)")
    return parser


def check_required_model_flags(args: argparse.Namespace) -> None:
    missing = [flag for flag in REQUIRED_MODEL_FLAGS if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join(missing)} (or --use-checkpoint-args "
                         "with --load of a checkpoint that holds them)")


def _attention_backend(args: argparse.Namespace) -> str:
    if not args.use_flash_attn:
        return args.attention_backend
    if args.attention_backend not in ("auto", "flash"):
        raise ValueError(f"--use-flash-attn and --attention-backend {args.attention_backend} ask for different "
                         "attention kernels; keep one")
    return "flash"


def _precision(args: argparse.Namespace) -> str:
    """fp16 | bf16 | fp32, from --fp16 / --bf16."""
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def _offloaded_layers(args: argparse.Namespace) -> int:
    """Layers per model chunk whose activations go to host memory (0: none); -1: all but the chunk's last
    (resolved when the chunk size is known)."""
    if not args.cpu_offloading:
        return 0
    n = args.cpu_offloading_num_layers
    if n is None:
        return -1
    if n < 1:
        raise ValueError(f"--cpu-offloading-num-layers {n} must be >= 1")
    return n


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """Reads --seed of the training flags too (weights are initialised from it)."""
    check_required_model_flags(args)
    if args.rotary_percent != 1.0:
        raise ValueError(f"--rotary-percent {args.rotary_percent}: partial rotary embeddings are not implemented "
                         "here; use 1.0 (every channel rotated)")
    granularity = "full" if args.checkpoint_activations else args.recompute_granularity
    if args.cpu_offloading_num_layers is not None and not args.cpu_offloading:
        raise ValueError("--cpu-offloading-num-layers without --cpu-offloading: add --cpu-offloading or drop it")
    if args.cpu_offloading and granularity == "full":
        raise ValueError("--cpu-offloading with --recompute-granularity full: full recompute keeps only each layer's "
                         "input, there is nothing left to offload; choose one (selective recompute combines)")
    if args.compile:
        _check_compile(args, granularity)
    rope = args.use_rotary_position_embeddings or args.position_embedding_type == "rope"
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        position_embedding_type="rope" if rope else args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
        openai_gelu=args.openai_gelu,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, precision=_precision(args),
        recompute_granularity=granularity,
        cpu_offloading_num_layers=_offloaded_layers(args),
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers, seed=args.seed,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion and not args.compile,
        attention_backend=_attention_backend(args), compile=args.compile, moe=moe_config_from_args(args))


def _check_compile(args: argparse.Namespace, granularity: str | None) -> None:
    """What a compiled layer cannot hold: hooks on the tensors it saves, a recompute region inside it, weight
    gradients kept for later."""
    if args.cpu_offloading:
        raise ValueError("--compile with --cpu-offloading: the offload hooks the tensors a layer saves, which the "
                         "compiled layers do not expose; drop one")
    if granularity == "selective":
        raise ValueError("--compile with --recompute-granularity selective: the recomputed attention core sits "
                         "inside the compiled layer; use --recompute-granularity full (whole layers) or drop one")
    if args.enable_zero_bubble or args.pipeline_schedule == "zb-h1":
        raise ValueError("--compile with --pipeline-schedule zb-h1: the split backward keeps the weight gradients "
                         "that layers write themselves, which compiled layers leave to autograd; drop one")
