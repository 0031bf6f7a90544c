"""Export a GPT checkpoint (any TP/PP, either format) to a Hugging Face transformers model directory.

    python tools/checkpoint/convert_to_hf.py --load CKPT_DIR [--iteration N] --output HF_DIR
    python tools/checkpoint/convert_to_hf.py --state-dict full_fp32.pt|CONSOLIDATED_DIR --args-from CKPT_DIR|args.json \
        --output HF_DIR
    # the run's tokenizer files moved: name them with the trainer's flags (--tokenizer-type, --vocab-file,
    # --merge-file, --tokenizer-model, --vocab-size), which replace what the checkpoint's args record
    python tools/checkpoint/convert_to_hf.py --load CKPT_DIR --output HF_DIR --vocab-file V.json --merge-file M.txt

GPT-2 blocks (learned positions, LayerNorm, GELU, biases) become ``GPT2LMHeadModel``; Llama blocks (RoPE, RMSNorm,
SwiGLU, optional GQA / untied head) become ``LlamaForCausalLM``; mixture-of-experts models become
``MixtralForCausalLM`` (no shared expert) or ``Qwen2MoeForCausalLM`` (a gated shared expert; QKV biases and dense
layers allowed), written with one matrix per expert as ``save_pretrained`` does. The model's shape comes from the
checkpoint's ``args``. A distributed checkpoint (the default format) and a consolidated directory are read one
tensor at a time and written in safetensors shards of at most ``--max-shard-size``, so memory is a shard, never the
model. The tokenizer the run trained with (hf_tokenizer.py) is written beside them, and its bos / eos / pad ids go
into config.json and generation_config.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.tokenizer import TokenizerConfig
from megatron.training.arguments.tokenizer import add_tokenizer_args
from tools.checkpoint.hf_mapping import hf_config, hf_tensors
from tools.checkpoint.hf_tokenizer import export_tokenizer
from tools.checkpoint.loader import load_args_from, model_config_from_args, open_checkpoint, open_state_dict
from tools.tool_errors import one_line_errors
from zero_cache.checkpoint import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"
RECORDED_TOKENIZER = TokenizerConfig()  # no field set: the tokenizer the checkpoint's args record


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * scale)
    return int(t)


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the umask (which can only be read by setting it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_hf(output: str, cfg: TransformerConfig, vocab_size: int, ours, max_shard_bytes: int,
             token_ids: dict[str, int | None]) -> int:
    """Write config.json and generation_config.json with ``token_ids`` (bos / eos / pad) and the weights as
    safetensors shards; returns the parameter count."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    os.makedirs(output, exist_ok=True)
    config = hf_config(cfg, vocab_size)
    config.update(token_ids)
    config.save_pretrained(output)
    GenerationConfig(**token_ids).save_pretrained(output)
    mode = _new_file_mode()
    shards: list[dict[str, str]] = []  # tensor names per shard
    shard: dict[str, torch.Tensor] = {}
    size, total = 0, 0

    def flush():
        nonlocal shard, size
        if shard:
            path = os.path.join(output, f"model-{len(shards) + 1:05d}.safetensors.tmp")
            save_file(shard, path, metadata={"format": "pt"})
            os.chmod(path, mode)  # safetensors writes through a private (0600) temporary file
            shards.append(list(shard))
        shard, size = {}, 0

    for name, t in hf_tensors(cfg, vocab_size, ours):
        t = t.to(cfg.params_dtype).contiguous()
        if shard and size + t.nbytes > max_shard_bytes:
            flush()
        shard[name] = t
        size += t.nbytes
        total += t.numel()
    flush()
    if len(shards) == 1:
        os.replace(os.path.join(output, "model-00001.safetensors.tmp"), os.path.join(output, "model.safetensors"))
        return total
    weight_map = {}
    for i, names in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(output, f"model-{i:05d}.safetensors.tmp"), os.path.join(output, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(output, SAFETENSORS_INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": sum(os.path.getsize(os.path.join(output, v))
                                                  for v in set(weight_map.values()))},
                   "weight_map": weight_map}, f, indent=1)
    return total


def _warn(message: str) -> None:
    print(f"convert_to_hf.py: warning: {message}", file=sys.stderr, flush=True)


def convert(output: str, *, load: str | None = None, iteration: int | None = None, state_dict: str | None = None,
            args_from: str | None = None, max_shard_size: str = "2GB",
            tokenizer: TokenizerConfig = RECORDED_TOKENIZER) -> str:
    """Read a checkpoint (or a consolidated state dict + args) and write a Hugging Face model to ``output``, with
    the tokenizer the checkpoint's args name (the fields ``tokenizer`` sets replace theirs).

    Returns the Hugging Face architecture written."""
    if (load is None) == (state_dict is None):
        raise CheckpointError("give exactly one input: --load CKPT_DIR, or --state-dict FILE with --args-from")
    if state_dict is not None:
        if args_from is None and os.path.isfile(os.path.join(state_dict, "args.json")):
            args_from = os.path.join(state_dict, "args.json")  # written by zero_to_fp32.py
        if args_from is None:
            raise CheckpointError("--state-dict needs --args-from CKPT_DIR|args.json for the model's shape")
        args = load_args_from(args_from)
        ours = open_state_dict(state_dict, args)
    else:
        args, ours = open_checkpoint(load, iteration)
        if args_from is not None:
            args = load_args_from(args_from)
    cfg = model_config_from_args(args)
    vocab = int(args.get("true_vocab_size") or cfg.padded_vocab_size)
    exported = export_tokenizer(args, tokenizer, vocab, cfg.max_position_embeddings, _warn)
    count = write_hf(output, cfg, vocab, ours, _parse_size(max_shard_size), exported.token_ids if exported else {})
    if exported is not None and exported.hf is not None:
        exported.hf.save_pretrained(output)
    arch = hf_config(cfg, vocab).architectures[0]
    print(f"> wrote {arch} ({count / 1e6:.2f}M parameters) to {output}", flush=True)
    return arch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", help="checkpoint directory (holds latest_checkpointed_iteration.txt)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    p.add_argument("--state-dict", help="full fp32 state dict file {name: tensor} (single-process names), or the "
                                        "directory zero_to_fp32.py / the consolidation writes")
    p.add_argument("--args-from", help="checkpoint directory or JSON file with the model args (for --state-dict)")
    p.add_argument("--output", required=True, help="Hugging Face model directory to write")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB, 2GB (default)")
    add_tokenizer_args(p)  # the trainer's flags; each one given replaces what the checkpoint's args record
    a = p.parse_args(argv)
    fix = "give a checkpoint directory (--load) or a state dict with --args-from, and a writable --output"
    with one_line_errors("convert_to_hf.py", fix, CheckpointError):
        convert(a.output, load=a.load, iteration=a.iteration, state_dict=a.state_dict, args_from=a.args_from,
                max_shard_size=a.max_shard_size,
                tokenizer=TokenizerConfig(tokenizer_type=a.tokenizer_type, vocab_file=a.vocab_file,
                                          merge_file=a.merge_file, tokenizer_model=a.tokenizer_model,
                                          vocab_size=a.vocab_size))


if __name__ == "__main__":
    main()
