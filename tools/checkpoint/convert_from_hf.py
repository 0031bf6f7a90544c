"""Start training from Hugging Face weights: GPT2LMHeadModel / LlamaForCausalLM / MixtralForCausalLM /
Qwen2MoeForCausalLM -> a distributed checkpoint.

    python tools/checkpoint/convert_from_hf.py --input HF_DIR --output CKPT_DIR \\
        [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P] [--make-vocab-size-divisible-by 128]

The checkpoint (``CKPT_DIR/iter_0000000``, tracker ``latest_checkpointed_iteration.txt``) holds the weights as
mesh-independent global tensors, without optimizer state: train from it with
``pretrain_gpt.py --load CKPT_DIR --finetune`` and the model flags this tool prints (also written to
``CKPT_DIR/model_flags.txt``), on any mesh. The vocabulary is padded for the given TP and divisor (rows beyond
Hugging Face's are zero); another padding loads too, and so does any expert-parallel size (the experts are
stored whole). Weights stream one tensor at a time from the ``*.safetensors`` files (or ``pytorch_model.bin``).
Unsupported architectures or config fields are one error naming the field.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.training.checkpoint.checkpointer import write_tracker
from megatron.training.checkpoint.names import iteration_dir
from tools.checkpoint.hf_mapping import args_from_hf, our_tensor
from tools.checkpoint.loader import MOE_ARGS, expected_names, moe_config_from_args
from tools.tool_errors import fail, one_line_errors
from zero_cache.checkpoint import CheckpointError, distributed
from zero_cache.checkpoint.interface import PARAM, StatePiece

_MODEL_FLAGS = [  # (argument, flag) in the order pretrain_gpt.py's help lists them
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"), ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"), ("kv_channels", "--kv-channels"),
    ("max_position_embeddings", "--max-position-embeddings"), ("seq_length", "--seq-length"),
    ("layernorm_epsilon", "--norm-epsilon"), ("hidden_dropout", "--hidden-dropout"),
    ("attention_dropout", "--attention-dropout")]


class _HFWeights:
    """Hugging Face tensors by name, read one at a time from safetensors files or a torch checkpoint."""

    def __init__(self, directory: str):
        from safetensors import safe_open
        self.files: dict[str, str] = {}
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                self.files = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single):
            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        elif os.path.isfile(binary := os.path.join(directory, "pytorch_model.bin")):
            self._bin = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
            self.files = dict.fromkeys(self._bin, None)
        else:
            raise CheckpointError(f"{directory} holds no model.safetensors, model.safetensors.index.json or "
                                  f"pytorch_model.bin: is it a Hugging Face model directory?")
        self._open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"the Hugging Face weights have no '{name}'; the model and its config disagree")
        path = self.files[name]
        if path is None:
            return self._bin[name].float()
        with self._open(path, "pt") as f:
            return f.get_tensor(name).float()


class _ConvertedStates:
    """A checkpoint source whose pieces are our whole tensors, computed from Hugging Face's when written."""

    def __init__(self, cfg: TransformerConfig, weights: _HFWeights):
        self.cfg, self.weights = cfg, weights
        self.shapes = {}
        self._current: tuple[str, torch.Tensor] | None = None
        for name in expected_names(cfg):
            self.shapes[name] = tuple(self._tensor(name).shape)

    def _tensor(self, name: str) -> torch.Tensor:
        if self._current is None or self._current[0] != name:
            self._current = None  # drop the previous tensor before building the next
            self._current = (name, our_tensor(self.cfg, name, self.weights).contiguous())
        return self._current[1]

    def state_pieces(self):
        return [StatePiece(n, s, 0, int(torch.Size(s).numel())) for n, s in self.shapes.items()]

    def read_state(self, piece, state, lo, hi):
        assert state == PARAM
        return self._tensor(piece.name).view(-1)[lo:hi]

    def write_state(self, piece, state, lo, values):
        raise RuntimeError("a converted checkpoint is only written")

    def replicated_tensors(self):
        return {}

    def training_state(self):
        return {"optimizer_step": 0, "loss_scaler": None}

    def load_training_state(self, state, load_optimizer):
        raise RuntimeError("a converted checkpoint is only written")

    def states_loaded(self):
        raise RuntimeError("a converted checkpoint is only written")


def padded(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def model_flags(args: dict) -> list[str]:
    """pretrain_gpt.py flags that build the model ``args`` describe."""
    flags = []
    for key, flag in _MODEL_FLAGS:
        flags += [flag, str(args[key])]
    if args["position_embedding_type"] == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", str(args["rotary_base"])]
    if args["normalization"] == "RMSNorm":
        flags += ["--normalization", "RMSNorm"]
    if args["swiglu"]:
        flags.append("--swiglu")
    if args["openai_gelu"]:
        flags.append("--openai-gelu")
    if not args["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if args["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    if args["group_query_attention"]:
        flags += ["--group-query-attention", "--num-query-groups", str(args["num_query_groups"])]
    if args.get("add_qkv_bias"):
        flags.append("--add-qkv-bias")
    if args.get("num_experts"):
        flags += ["--num-experts", str(args["num_experts"])]
        for key in MOE_ARGS.values():
            value = args.get(key)
            if value is not None and value is not False:
                flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return flags


def convert(input_dir: str, output_dir: str, *, tp: int = 1, pp: int = 1, divisible_by: int = 128) -> list[str]:
    """Write the checkpoint; returns the model flags to train it with."""
    from transformers import AutoConfig
    try:
        hf = AutoConfig.from_pretrained(input_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{input_dir}: no readable Hugging Face config.json ({e})") from None
    args = args_from_hf(hf)
    if args["num_layers"] % pp:
        raise CheckpointError(f"--pipeline-model-parallel-size {pp} does not divide the model's {args['num_layers']} "
                              f"layers (num_hidden_layers / n_layer)")
    groups = args["num_query_groups"]
    if groups % tp or args["num_attention_heads"] % tp:
        raise CheckpointError(f"--tensor-model-parallel-size {tp} does not divide the attention heads "
                              f"({args['num_attention_heads']}) and query groups ({groups})")
    args.update(padded_vocab_size=padded(args["true_vocab_size"], divisible_by, tp),
                make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp)
    keys = {f.name for f in dataclasses.fields(TransformerConfig)}
    cfg = TransformerConfig(**{k: v for k, v in args.items() if k in keys and k != "group_query_attention"},
                            moe=moe_config_from_args(args))
    source = _ConvertedStates(cfg, _HFWeights(input_dir))
    os.makedirs(output_dir, exist_ok=True)
    distributed.save(iteration_dir(output_dir, 0), source, optimizer=False,
                     objects={"args": args, "iteration": 0, "consumed_samples": 0, "converted_from": input_dir})
    write_tracker(output_dir, 0)
    flags = model_flags(args)
    with open(os.path.join(output_dir, "model_flags.txt"), "w", encoding="utf-8") as f:
        f.write(" ".join(flags) + "\n")
    return flags


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Hugging Face model directory (config.json and weights)")
    p.add_argument("--output", required=True, help="checkpoint directory to write (pass it to --load)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="the TP you will train with: the vocabulary is padded for it (others load too)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="checked against the layers")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a = p.parse_args(argv)
    fix = "give a Hugging Face model directory (config.json and its weights) and a writable --output"
    if not os.path.isdir(a.input):
        fail("convert_from_hf.py", f"--input {a.input} {'is a file' if os.path.exists(a.input) else 'does not exist'}"
                                   f"; {fix}")
    with one_line_errors("convert_from_hf.py", fix, CheckpointError):
        flags = convert(a.input, a.output, tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size,
                        divisible_by=a.make_vocab_size_divisible_by)
    print(f"> wrote {iteration_dir(a.output, 0)}; train from it with:\n  pretrain_gpt.py {shlex.join(flags)} "
          f"--load {a.output} --finetune ...", flush=True)


if __name__ == "__main__":
    main()
