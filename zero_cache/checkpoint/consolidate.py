"""Merge a zero_cache checkpoint into one fp32 state dict (DeepSpeed's zero_to_fp32).

    python -m zero_cache.checkpoint.consolidate <ckpt_dir> <out_dir> [--tag TAG] [--mp-rank K]

Both layouts are read. The distributed checkpoint (``distributed.py``) already holds whole global tensors:
each is read on its own (its chunks from every rank's file) and written out, so memory is the largest tensor.
The per-rank layout (``sharded.py``) is assembled as described below.

Output: a *directory* with one ``<name>.pt`` file per tensor (fp32 parameters, plus buffers and frozen
parameters) and ``index.json`` (written last) mapping every state-dict key, tied aliases included, to its
file. Load it with ``load_consolidated(out_dir)``. Each tensor is assembled from the ranks' shards, written
and dropped in turn; shards are read from memory-mapped files, one slice file open at a time (its
checksum verified when first opened), so peak memory is one output tensor plus one slice, not the model.
One model-parallel rank is consolidated per call (``--mp-rank``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

from . import distributed
from .errors import CheckpointError
from .names import latest_path
from .sharded import READABLE, file_prefix, flat, latest_tag
from .slices import SliceFiles, atomic_torch_save


class _Masters:
    """Ranges of every DP rank's fp32 master stream, from its slices (one open at a time) or flat tensor."""

    def __init__(self, tag_dir: str, paths: list[str], metas: list[dict]):
        self.sources = []
        for path, meta in zip(paths, metas):
            if "slices" in meta:
                files = SliceFiles(tag_dir, path, meta["slices"])
                files.check_present()
                self.sources.append(files)
            else:
                self.sources.append(flat(meta["master"]))
        self._open: tuple[tuple[int, int] | None, torch.Tensor | None] = (None, None)

    def copy(self, rank: int, lo: int, hi: int, out: torch.Tensor) -> None:
        src = self.sources[rank]
        if isinstance(src, torch.Tensor):
            out.copy_(src[lo:hi])
            return
        for k, a, b, pos in src.locate(lo, hi):
            if self._open[0] != (rank, k):
                self._open = (None, None)  # drop the previous slice before mapping the next
                self._open = ((rank, k), src.load(k)["master"])
            out[pos:pos + b - a].copy_(self._open[1][a:b])


def _file_name(name: str) -> str:
    return name.replace(os.sep, "_") + ".pt"


def _progress(done: int, total: int, t0: float) -> None:
    rate = done / max(time.perf_counter() - t0, 1e-9)
    print(f"\r[consolidate] {done}/{total} tensors, {rate:.1f}/s, ETA {(total - done) / rate:.0f}s",
          end="", file=sys.stderr, flush=True)


def _write_index(out_dir: str, content: dict) -> None:
    tmp = os.path.join(out_dir, f"index.json.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "index.json"))


def _consolidate_distributed(tag_dir: str, out_dir: str, tag: str, progress: bool) -> dict:
    """One file per global tensor of a distributed checkpoint, read one tensor at a time."""
    keys = distributed.read_index(tag_dir)
    objects = distributed.load_objects(tag_dir, [k for k in ("training_state", "param_aliases")
                                                 if distributed.object_key(k) in keys])
    aliases = objects.get("param_aliases", {})
    names = [(k.split("/", 1)[1], k.split("/", 1)[0]) for k in keys
             if k.startswith((distributed.PARAM + "/", "tensor/"))]
    os.makedirs(out_dir, exist_ok=True)
    index: dict[str, dict] = {}
    t0 = time.perf_counter()
    for done, (name, kind) in enumerate(names, 1):
        t = distributed.load_tensor(tag_dir, name, kind)
        fname = _file_name(name)
        atomic_torch_save(t, os.path.join(out_dir, fname))
        for alias in aliases.get(name, [name]):
            index[alias] = {"file": fname, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        del t
        if progress:
            _progress(done, len(names), t0)
    if progress:
        print(file=sys.stderr)
    steps = objects.get("training_state", {}).get("optimizer_step")
    _write_index(out_dir, {"tag": tag, "global_steps": steps, "tensors": index})
    return index


def consolidate(ckpt_dir: str, out_dir: str, tag: str | None = None, mp_rank: int = 0,
                progress: bool = False) -> dict:
    tag = tag or latest_tag(ckpt_dir)
    tag_dir = os.path.join(ckpt_dir, tag)
    if distributed.is_checkpoint(tag_dir):
        return _consolidate_distributed(tag_dir, out_dir, tag, progress)
    first = os.path.join(tag_dir, file_prefix(0, mp_rank) + "_model_states.pt")
    if not os.path.isfile(first):
        raise FileNotFoundError(f"{first} is missing: is '{tag_dir}' a zero_cache checkpoint with mp rank {mp_rank}?")
    meta = torch.load(first, map_location="cpu", weights_only=True, mmap=True)
    if meta.get("format") not in READABLE:
        raise ValueError(f"{first}: not a zero_cache checkpoint")
    dp = meta["dp_world_size"]
    paths, metas = [first], [meta]
    for r in range(1, dp):
        path = os.path.join(tag_dir, file_prefix(r, mp_rank) + "_model_states.pt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was saved by {dp} data-parallel ranks")
        paths.append(path)
        metas.append(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    masters = _Masters(tag_dir, paths, metas)
    layout = meta["layout"]
    starts = list(itertools.accumulate((c["shard"] for c in layout), initial=0))  # chunk offsets in the streams
    os.makedirs(out_dir, exist_ok=True)
    index: dict[str, dict] = {}
    total = sum(len(c["slots"]) for c in layout)
    done, t0 = 0, time.perf_counter()
    for ci, c in enumerate(layout):
        s_len = c["shard"]
        for slot in c["slots"]:
            t = torch.empty(slot["numel"], dtype=torch.float32)
            lo, hi = slot["offset"], slot["offset"] + slot["numel"]
            for r in range(dp):
                a, b = max(lo, r * s_len), min(hi, (r + 1) * s_len)
                if a < b:
                    off = starts[ci] - r * s_len
                    masters.copy(r, a + off, b + off, t[a - lo:b - lo])
            fname = _file_name(slot["name"])
            atomic_torch_save(t.view(slot["shape"]), os.path.join(out_dir, fname))
            for alias in meta["aliases"][slot["name"]]:
                index[alias] = {"file": fname, "shape": slot["shape"], "dtype": "float32"}
            done += 1
            if progress:
                _progress(done, total, t0)
    for kind in ("frozen", "buffers"):
        for name, t in meta[kind].items():
            fname = _file_name(name)
            atomic_torch_save(t.clone(), os.path.join(out_dir, fname))
            index[name] = {"file": fname, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if progress:
        print(file=sys.stderr)
    _write_index(out_dir, {"tag": tag, "mp_rank": mp_rank, "global_steps": meta["global_steps"], "tensors": index})
    return index


def load_consolidated(out_dir: str) -> dict[str, torch.Tensor]:
    """The whole consolidated state dict in memory (tied aliases share one tensor)."""
    with open(os.path.join(out_dir, "index.json"), encoding="utf-8") as f:
        index = json.load(f)["tensors"]
    loaded: dict[str, torch.Tensor] = {}
    return {name: loaded.setdefault(e["file"], torch.load(os.path.join(out_dir, e["file"]), weights_only=True))
            for name, e in index.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m zero_cache.checkpoint.consolidate", description=__doc__.split("\n")[0])
    ap.add_argument("ckpt_dir", help="checkpoint directory (holds 'latest' and the tag folders)")
    ap.add_argument("out_dir", help="output directory: one .pt file per tensor plus index.json")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    ap.add_argument("--mp-rank", type=int, default=0, help="model-parallel rank to consolidate")
    args = ap.parse_args(argv)
    if args.tag is None and not os.path.isfile(latest_path(args.ckpt_dir)):
        _fail(f"{args.ckpt_dir} has no 'latest' file naming a checkpoint; pass --tag (the tag folder under it) or, "
              f"for a pretrain_gpt.py --save directory, use tools/checkpoint/zero_to_fp32.py")
    try:
        index = consolidate(args.ckpt_dir, args.out_dir, args.tag, args.mp_rank, progress=True)
    except (CheckpointError, OSError, ValueError) as e:
        _fail(str(e))
    print(f"[consolidate] wrote {len(index)} state-dict entries to {args.out_dir}")


def _fail(message: str) -> None:
    print(f"ptm-consolidate: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
