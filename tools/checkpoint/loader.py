"""Reassemble the full (single-process) state dict of a GPTModel from a Megatron-layout checkpoint.

Any TP/PP, with or without interleaved model chunks: partitioned tensors are
concatenated along their partition dim in tensor-parallel rank order (each rank
holds a contiguous chunk of the full tensor), replicated ones are taken from tp
rank 0, and chunk-local layer indices become global ones. The result uses the
names of a GPTModel built with TP = PP = 1 ("full names"), the same convention a
ZeRO consolidation tool writes.
Files are opened one at a time with mmap, so only the model weights are read.
"""
from __future__ import annotations

import json
import os
import re

import torch

from megatron.core.moe.config import MoEConfig, parse_layer_freq
from megatron.core.transformer_config import TransformerConfig
from megatron.model.gpt_model import stage_layers
from megatron.training.checkpoint.checkpointer import read_tracker
from megatron.training.checkpoint.legacy import checkpoint_file, load_file, model_keys, saved_mesh
from megatron.training.checkpoint.names import iteration_dir, tracker_path
from zero_cache.checkpoint import CheckpointError, distributed

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Suffix -> partition dim (None: replicated). Column-parallel outputs and the vocabulary split along dim 0,
# row-parallel inputs along dim 1; row-parallel biases, norms and positions are replicated.
_PARTITION_DIMS = {
    "self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1, "self_attention.linear_proj.bias": None,
    "mlp.linear_fc1.weight": 0, "mlp.linear_fc1.bias": 0,
    "mlp.linear_fc1_gate.weight": 0, "mlp.linear_fc1_gate.bias": 0,
    "mlp.linear_fc2.weight": 1, "mlp.linear_fc2.bias": None,
    "input_layernorm.weight": None, "input_layernorm.bias": None,
    "pre_mlp_layernorm.weight": None, "pre_mlp_layernorm.bias": None,
    WORD_EMBEDDING: 0, OUTPUT_LAYER: 0, "embedding.position_embeddings.weight": None,
    "final_layernorm.weight": None, "final_layernorm.bias": None,
    # MoE layers: the router is replicated; experts [E, f, h] / [E, h, f] split f (expert parallelism splits E,
    # which this legacy reader does not join); the shared expert is split like the dense MLP.
    "mlp.router.weight": None, "mlp.router.expert_bias": None, "mlp.experts.linear_fc1.weight": 1,
    "mlp.experts.linear_fc1_gate.weight": 1, "mlp.experts.linear_fc2.weight": 2,
    "mlp.shared_experts.linear_fc1.weight": 0, "mlp.shared_experts.linear_fc1.bias": 0,
    "mlp.shared_experts.linear_fc1_gate.weight": 0, "mlp.shared_experts.linear_fc1_gate.bias": 0,
    "mlp.shared_experts.linear_fc2.weight": 1, "mlp.shared_experts.linear_fc2.bias": None,
    "mlp.shared_experts.gate_weight": None,
}
_CONFIG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "padded_vocab_size",
                "ffn_hidden_size", "num_query_groups", "kv_channels", "max_position_embeddings",
                "position_embedding_type", "rotary_base", "normalization", "layernorm_epsilon", "swiglu",
                "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights", "openai_gelu")
# MoEConfig field -> the Megatron argument that sets it (the flag without its dashes)
MOE_ARGS = {"router_topk": "moe_router_topk", "ffn_hidden_size": "moe_ffn_hidden_size", "layer_freq": "moe_layer_freq",
            "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
            "shared_expert_gate": "moe_shared_expert_gate", "score_function": "moe_router_score_function",
            "pre_softmax": "moe_router_pre_softmax", "topk_scaling_factor": "moe_router_topk_scaling_factor",
            "enable_expert_bias": "moe_router_enable_expert_bias", "aux_loss_coeff": "moe_aux_loss_coeff"}
_REQUIRED_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "padded_vocab_size")


def partition_dim(name: str) -> int | None:
    """The dim a parameter (full or stage-local name) is split along under tensor parallelism."""
    m = _LAYER.match(name)
    suffix = m.group(2) if m else name
    if suffix not in _PARTITION_DIMS:
        raise CheckpointError(f"unknown parameter {name!r} in the checkpoint; the converter knows GPTModel's "
                              f"parameters only ({', '.join(sorted(_PARTITION_DIMS))})")
    return _PARTITION_DIMS[suffix]


def model_config_from_args(args: dict) -> TransformerConfig:
    """A TransformerConfig from a checkpoint's Megatron-style ``args`` dict (missing optional keys: defaults)."""
    missing = [k for k in _REQUIRED_KEYS if args.get(k) is None]
    if missing:
        raise CheckpointError(f"the checkpoint's args lack {missing}; pass --args-from with a JSON file "
                              "holding the model arguments")
    kw = {k: args[k] for k in _CONFIG_KEYS if args.get(k) is not None}
    if args.get("group_query_attention") is False and "num_query_groups" in kw \
            and kw["num_query_groups"] != kw["num_attention_heads"]:
        kw.pop("num_query_groups")  # Megatron ignores --num-query-groups without --group-query-attention
    return TransformerConfig(**kw, moe=moe_config_from_args(args), hidden_dropout=0.0, attention_dropout=0.0)


def moe_config_from_args(args: dict) -> MoEConfig | None:
    """The MoEConfig of ``--num-experts`` and the ``--moe-*`` args; None for a dense model."""
    experts = args.get("num_experts")
    if isinstance(experts, (list, tuple)):  # Megatron-DeepSpeed spells --num-experts as a list
        experts = max(experts)
    if not experts or experts < 2:
        return None
    kw = {field: args[arg] for field, arg in MOE_ARGS.items() if args.get(arg) is not None}
    freq = kw.get("layer_freq")
    if isinstance(freq, str):
        kw["layer_freq"] = parse_layer_freq(freq)
    elif isinstance(freq, list):
        kw["layer_freq"] = tuple(freq)
    try:
        return MoEConfig(num_experts=experts, **kw)
    except ValueError as e:
        raise CheckpointError(f"the checkpoint's MoE arguments are invalid: {e}") from None


def expected_names(cfg: TransformerConfig) -> list[str]:
    """Full parameter names of a GPTModel with this config under TP = PP = 1 (EP = 1)."""
    norm = ["weight", "bias"] if cfg.normalization == "LayerNorm" else ["weight"]
    linear = ["weight", "bias"] if cfg.add_bias_linear else ["weight"]
    qkv = ["weight", "bias"] if cfg.add_bias_linear or cfg.add_qkv_bias else ["weight"]
    names = [WORD_EMBEDDING]
    if cfg.position_embedding_type == "learned_absolute":
        names.append("embedding.position_embeddings.weight")
    mlp = ["linear_fc1", "linear_fc1_gate", "linear_fc2"] if cfg.swiglu else ["linear_fc1", "linear_fc2"]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm." + n for n in norm]
        names += [p + "self_attention.linear_qkv." + n for n in qkv]
        names += [p + "self_attention.linear_proj." + n for n in linear]
        names += [p + "pre_mlp_layernorm." + n for n in norm]
        if not cfg.is_moe_layer(i):
            names += [p + f"mlp.{m}.{n}" for m in mlp for n in linear]
            continue
        names.append(p + "mlp.router.weight")
        names += [p + f"mlp.experts.{m}.weight" for m in mlp]  # the experts have no biases
        if cfg.moe.shared_expert_intermediate_size:
            names += [p + f"mlp.shared_experts.{m}.{n}" for m in mlp for n in linear]
            if cfg.moe.shared_expert_gate:
                names.append(p + "mlp.shared_experts.gate_weight")
    names += ["final_layernorm." + n for n in norm]
    if cfg.untie_embeddings_and_output_weights:
        names.append(OUTPUT_LAYER)
    return names


def check_full_state_dict(cfg: TransformerConfig, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise a clear error when ``state`` does not hold exactly the parameters (and shapes) ``cfg`` implies."""
    want = expected_names(cfg)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise CheckpointError(f"{source} does not match the model arguments: missing {missing[:6]}"
                              f"{'...' if len(missing) > 6 else ''}, unexpected {extra[:6]}"
                              f"{'...' if len(extra) > 6 else ''}; check --args-from / the checkpoint's args")
    d, h = cfg.kv_channels, cfg.hidden_size
    shapes = {WORD_EMBEDDING: (cfg.padded_vocab_size, h),
              "decoder.layers.0.self_attention.linear_qkv.weight":
                  ((cfg.num_attention_heads + 2 * cfg.num_query_groups) * d, h)}
    dense = next((i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)), None)
    if dense is not None:
        shapes[f"decoder.layers.{dense}.mlp.linear_fc1.weight"] = (cfg.ffn_hidden_size, h)
    if cfg.moe is not None and dense != 0:
        f = cfg.moe.expert_ffn_hidden_size(cfg.ffn_hidden_size)
        shapes["decoder.layers.0.mlp.experts.linear_fc1.weight"] = (cfg.moe.num_experts, f, h)
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(state[name].shape)} but the model arguments "
                                  f"imply {shape}; the args (hidden size, heads, query groups, kv channels, "
                                  "vocabulary, ffn size, experts) do not describe these weights")


def resolve_iteration(load_dir: str, iteration: int | None = None) -> int:
    if iteration is not None:
        return iteration
    it = read_tracker(load_dir)
    if it is None:
        raise CheckpointError(f"{tracker_path(load_dir)} does not exist: {load_dir} holds no complete "
                              "checkpoint (pass --iteration N to read iter_N anyway)")
    return it


def _distributed_dir(load_dir: str, iteration: int) -> str | None:
    """The iteration's directory when it is a distributed checkpoint, else None (Megatron's legacy layout)."""
    path = iteration_dir(load_dir, iteration)
    return path if distributed.is_checkpoint(path) else None


def read_args(load_dir: str, iteration: int | None = None) -> dict:
    """The ``args`` dict stored in a checkpoint (legacy layout: read from the first file, memory-mapped)."""
    it = resolve_iteration(load_dir, iteration)
    path = _distributed_dir(load_dir, it)
    if path is not None:
        return dict(distributed.load_objects(path, ["args"])["args"])
    _, pp = saved_mesh(load_dir, it)
    return dict(load_file(checkpoint_file(load_dir, it, 0, 0, pp), mmap=True)["args"])


def load_args_from(path: str) -> dict:
    """``--args-from``: a Megatron checkpoint directory (its latest iteration) or a JSON file of args."""
    if os.path.isdir(path):
        return read_args(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"--args-from {path}: no such file or directory; give a checkpoint directory "
                              "or a JSON file of model arguments")
    with open(path, encoding="utf-8") as f:
        try:
            args = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"--args-from {path} is not valid JSON ({e})") from e
    if not isinstance(args, dict):
        raise CheckpointError(f"--args-from {path} holds a JSON {type(args).__name__}, not an object of model "
                              f"arguments; give the args.json zero_to_fp32.py writes, or a checkpoint directory")
    return args


def global_name(name: str, layer_offset: int) -> str:
    m = _LAYER.match(name)
    return f"decoder.layers.{layer_offset + int(m.group(1))}.{m.group(2)}" if m else name


def load_full_state_dict(load_dir: str, iteration: int | None = None,
                         progress=print) -> tuple[dict, dict[str, torch.Tensor]]:
    """(args, full state dict) of a Megatron-layout checkpoint of any TP/PP."""
    it = resolve_iteration(load_dir, iteration)
    tp, pp = saved_mesh(load_dir, it)
    args = read_args(load_dir, it)
    for key, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if args.get(key, size) != size:
            raise CheckpointError(f"{iteration_dir(load_dir, it)} holds files of {key.split('_')[0]}-parallel size "
                                  f"{size} but its args say {key}={args[key]}; the checkpoint is inconsistent")
    cfg = model_config_from_args(args)
    tied = not cfg.untie_embeddings_and_output_weights
    full: dict[str, torch.Tensor] = {}
    for p in range(pp):
        shards: dict[str, list[torch.Tensor]] = {}  # global name -> one tensor per tensor-parallel rank
        for t in range(tp):
            path = checkpoint_file(load_dir, it, t, p, pp)
            progress(f"> reading {path}")
            state = load_file(path, mmap=True)
            keys = model_keys(state)
            for chunk, key in enumerate(keys):
                try:
                    offset, _ = stage_layers(cfg.num_layers, pp, p, len(keys), chunk)
                except ValueError as e:
                    raise CheckpointError(f"{path}: {e} (from the checkpoint's args); the checkpoint is "
                                          "inconsistent") from None
                for name, tensor in state[key].items():
                    if tied and name == OUTPUT_LAYER:
                        continue  # the last stage's copy of the tied word embedding
                    shards.setdefault(global_name(name, offset), []).append(tensor)
        for name, parts in shards.items():
            if len(parts) != tp:
                raise CheckpointError(f"{name} is held by {len(parts)} of {tp} tensor-parallel files of stage {p}")
            dim = partition_dim(name)
            full[name] = parts[0].clone() if dim is None else torch.cat(parts, dim)
    check_full_state_dict(cfg, full, f"checkpoint {load_dir} iteration {it}")
    return args, full


def load_consolidated_state_dict(path: str, args: dict) -> dict[str, torch.Tensor]:
    """``--state-dict``: a full fp32 state dict ``{full name: tensor}``: one file, or the directory that
    ``tools/checkpoint/zero_to_fp32.py`` writes (index.json + one file per tensor)."""
    if os.path.isdir(path):
        from zero_cache.checkpoint.consolidate import load_consolidated
        if not os.path.isfile(os.path.join(path, "index.json")):
            raise CheckpointError(f"--state-dict {path} is a directory without index.json: an unfinished "
                                  "consolidation? Run tools/checkpoint/zero_to_fp32.py again")
        state = load_consolidated(path)
    else:
        state = load_file(path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"--state-dict {path} must hold a flat dict {{parameter name: tensor}}")
    check_full_state_dict(model_config_from_args(args), state, f"--state-dict {path}")
    return state


def _lazy(names: set[str], read) -> callable:
    """``read(name)`` for the names a checkpoint has; a clear error for the others."""
    def get(name: str) -> torch.Tensor:
        if name not in names:
            raise CheckpointError(f"the checkpoint holds no '{name}'; its args do not describe its weights")
        return read(name)
    return get


def open_checkpoint(load_dir: str, iteration: int | None = None) -> tuple[dict, callable]:
    """(args, ``read(full name) -> tensor``) of a checkpoint of either format. A distributed checkpoint is read
    one global tensor per call; the legacy layout is reassembled in memory first."""
    it = resolve_iteration(load_dir, iteration)
    path = _distributed_dir(load_dir, it)
    if path is None:
        args, full = load_full_state_dict(load_dir, it, progress=lambda msg: None)
        return args, full.__getitem__
    args = read_args(load_dir, it)
    index = distributed.read_index(path)
    metadata = distributed.verified_metadata(path)
    names = {k.split("/", 1)[1] for k in index if k.startswith(distributed.PARAM + "/")}
    missing = sorted(set(expected_names(model_config_from_args(args))) - names)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing[:5]} that its args imply")
    return args, _lazy(names, lambda n: distributed.load_tensor(path, n, metadata=metadata))


def open_state_dict(path: str, args: dict) -> callable:
    """``read(full name) -> tensor`` of a consolidated directory (one file read per call) or a state dict file."""
    cfg = model_config_from_args(args)
    if not os.path.isdir(path):
        return load_consolidated_state_dict(path, args).__getitem__
    index_path = os.path.join(path, "index.json")
    if not os.path.isfile(index_path):
        raise CheckpointError(f"--state-dict {path} is a directory without index.json: an unfinished "
                              "consolidation? Run tools/checkpoint/zero_to_fp32.py again")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)["tensors"]
    missing = sorted(set(expected_names(cfg)) - set(index))
    if missing:
        raise CheckpointError(f"--state-dict {path} lacks {missing[:5]} that the model arguments imply")
    return _lazy(set(index), lambda n: load_file(os.path.join(path, index[n]["file"])))
