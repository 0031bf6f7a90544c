"""Consolidate a checkpoint written by ``pretrain_gpt.py`` into one fp32 state dict, one file per tensor.

    python tools/checkpoint/zero_to_fp32.py <save dir> <out dir> [--tag iter_0000100|global_step100]

The output directory holds one ``<name>.pt`` per tensor with the single-process
model's names (global layer indices, tensor-parallel shards concatenated),
``args.json`` (the run's model arguments) and ``index.json`` (written last).
A distributed checkpoint (``--ckpt-format torch_dist``, the default; the tag defaults to the iteration
the tracker names) holds global tensors already: each is read and written on its own. The per-rank layout
of ``--deepspeed --ckpt-format torch`` (tag default: ``latest``) streams too: the engine's consolidation
assembles one data-parallel-sharded
tensor at a time per model-parallel rank from the checkpoint's slice files
(one open at a time), and the tensor-parallel pieces of one tensor are read
memory-mapped and copied into the joined tensor before the next is read, so
memory is one output tensor plus one slice or piece, never the model. ``convert_to_hf.py --state-dict
<out dir>`` exports it to Hugging Face.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from megatron.training.checkpoint.checkpointer import read_tracker
from megatron.training.checkpoint.names import TRACKER, iteration_dirname
from tools.checkpoint.loader import OUTPUT_LAYER, global_name, partition_dim
from tools.tool_errors import fail, one_line_errors
from zero_cache.checkpoint import CheckpointError, distributed
from zero_cache.checkpoint.consolidate import consolidate
from zero_cache.checkpoint.names import latest_path
from zero_cache.checkpoint.sharded import file_prefix, latest_tag
from zero_cache.checkpoint.slices import atomic_torch_save

PROG = "zero_to_fp32.py"


def _read_args(save_dir: str, tag: str) -> dict:
    path = os.path.join(save_dir, tag, file_prefix(0, 0) + "_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {save_dir} holds no checkpoint tagged {tag!r} of pretrain_gpt.py "
                              f"--deepspeed; give its --save directory (and --tag of a checkpoint in it)")
    try:
        client = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("client_state", {})
    except (RuntimeError, pickle.UnpicklingError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint file ({str(e).splitlines()[0]}); it is "
                              f"damaged or not pretrain_gpt.py's: consolidate another one (--tag)") from None
    if "args" not in client:
        raise CheckpointError(f"{path} carries no trainer args; it was not written by pretrain_gpt.py: give the "
                              f"--save directory of a pretrain_gpt.py run")
    return dict(client["args"])


def _default_tag(save_dir: str) -> str:
    """The per-rank layout's latest tag ('latest' names it)."""
    if not os.path.isfile(latest_path(save_dir)):
        raise CheckpointError(f"{save_dir} holds no checkpoint: neither {TRACKER} (pretrain_gpt.py) nor 'latest' "
                              f"(--ckpt-format torch); give the --save directory of a run that saved, or --tag")
    return latest_tag(save_dir)


def _load_mapped(path: str) -> torch.Tensor:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _join(pieces: list[tuple[str, list[int]]], dim: int | None) -> torch.Tensor:
    """One tensor from its tensor-parallel (path, shape) pieces (replicated: the first), mapped one at a time."""
    if dim is None or len(pieces) == 1:
        return _load_mapped(pieces[0][0])
    shape = list(pieces[0][1])
    shape[dim] = sum(s[dim] for _, s in pieces)
    full = torch.empty(shape, dtype=_load_mapped(pieces[0][0]).dtype)
    at = 0
    for path, s in pieces:
        full.narrow(dim, at, s[dim]).copy_(_load_mapped(path))
        at += s[dim]
    return full


def _distributed_tag(save_dir: str, tag: str | None) -> str | None:
    """The tag of a distributed checkpoint to consolidate, or None for the per-rank layout."""
    if tag is None:
        iteration = read_tracker(save_dir)
        if iteration is None:
            return None
        tag = iteration_dirname(iteration)
    return tag if distributed.is_checkpoint(os.path.join(save_dir, tag)) else None


def _write_args(out_dir: str, args: dict) -> None:
    with open(os.path.join(out_dir, "args.json"), "w", encoding="utf-8") as f:
        json.dump(args, f, indent=1)


def zero_to_fp32(save_dir: str, out_dir: str, tag: str | None = None) -> dict[str, dict]:
    dist_tag = _distributed_tag(save_dir, tag)
    if dist_tag is not None:
        os.makedirs(out_dir, exist_ok=True)
        _write_args(out_dir, dict(distributed.load_objects(os.path.join(save_dir, dist_tag), ["args"])["args"]))
        return consolidate(save_dir, out_dir, dist_tag)
    tag = tag or _default_tag(save_dir)
    args = _read_args(save_dir, tag)
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    per_stage = args["num_layers"] // pp
    tied = not args.get("untie_embeddings_and_output_weights", False)
    os.makedirs(out_dir, exist_ok=True)
    index: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".mp_ranks.") as tmp:
        for p in range(pp):
            # The engine's model-parallel rank is the rank in the TP x PP group: stage-major, then tp.
            parts = []
            for t in range(tp):
                part_dir = os.path.join(tmp, f"mp{p * tp + t}")
                consolidate(save_dir, part_dir, tag, p * tp + t)
                with open(os.path.join(part_dir, "index.json"), encoding="utf-8") as f:
                    parts.append((part_dir, json.load(f)["tensors"]))
            for name in parts[0][1]:
                if tied and name == OUTPUT_LAYER and p == pp - 1 and pp > 1:
                    continue  # the last stage's copy of the tied word embedding
                full = _join([(os.path.join(d, idx[name]["file"]), idx[name]["shape"]) for d, idx in parts],
                             partition_dim(name))
                gname = global_name(name, p * per_stage)
                fname = gname + ".pt"
                atomic_torch_save(full, os.path.join(out_dir, fname))
                index[gname] = {"file": fname, "shape": list(full.shape),
                                "dtype": str(full.dtype).removeprefix("torch.")}
                del full
            for d, _ in parts:
                shutil.rmtree(d)
    _write_args(out_dir, args)
    tmp_index = os.path.join(out_dir, f"index.json.tmp.{os.getpid()}")
    with open(tmp_index, "w", encoding="utf-8") as f:
        json.dump({"tag": tag, "tensors": index}, f, indent=1)
    os.replace(tmp_index, os.path.join(out_dir, "index.json"))
    return index


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("save_dir", help="the --save directory of a pretrain_gpt.py --deepspeed run")
    ap.add_argument("out_dir", help="output directory: one fp32 .pt per tensor, args.json, index.json")
    ap.add_argument("--tag", default=None, help="checkpoint tag, e.g. iter_0000100 or global_step100 (default: the "
                                                "latest: the tracker's iteration, else the per-rank layout's latest)")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.save_dir):
        fail(PROG, f"{a.save_dir} {'is a file' if os.path.exists(a.save_dir) else 'does not exist'}; give the --save "
                   f"directory of a pretrain_gpt.py run")
    with one_line_errors(PROG, "give the --save directory of a pretrain_gpt.py run and a writable output directory",
                         CheckpointError):
        index = zero_to_fp32(a.save_dir, a.out_dir, a.tag)
    print(f"zero_to_fp32: wrote {len(index)} tensors to {a.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
