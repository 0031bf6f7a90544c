"""Merge a sharded zero_cache checkpoint into one fp32 state dict (DeepSpeed's zero_to_fp32).

    python -m zero_cache.checkpoint.consolidate <ckpt_dir> <out_dir> [--tag TAG] [--mp-rank K]

Output: a *directory* with one ``<name>.pt`` file per tensor (fp32 parameters, plus buffers and frozen
parameters) and ``index.json`` (written last) mapping every state-dict key, tied aliases included, to its
file. Load it with ``load_consolidated(out_dir)``. The shard files are memory-mapped and each tensor is
assembled, written and dropped in turn, so peak memory is the largest tensor, not the model.
One model-parallel rank is consolidated per call (``--mp-rank``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from .sharded import FORMAT, atomic_torch_save, file_prefix, latest_tag, unpack


def _file_name(name: str) -> str:
    return name.replace(os.sep, "_") + ".pt"


def consolidate(ckpt_dir: str, out_dir: str, tag: str | None = None, mp_rank: int = 0,
                progress: bool = False) -> dict:
    tag = tag or latest_tag(ckpt_dir)
    tag_dir = os.path.join(ckpt_dir, tag)
    first = os.path.join(tag_dir, file_prefix(0, mp_rank) + "_model_states.pt")
    if not os.path.isfile(first):
        raise FileNotFoundError(f"{first} is missing: is '{tag_dir}' a zero_cache checkpoint with mp rank {mp_rank}?")
    meta = torch.load(first, map_location="cpu", weights_only=True, mmap=True)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{first}: not a zero_cache checkpoint")
    dp = meta["dp_world_size"]
    ranks = [meta]
    for r in range(1, dp):
        path = os.path.join(tag_dir, file_prefix(r, mp_rank) + "_model_states.pt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was saved by {dp} data-parallel ranks")
        ranks.append(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    layout = meta["layout"]
    shards = [c["shard"] for c in layout]
    masters = [unpack(s["master"], shards) for s in ranks]
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
                    t[a - lo:b - lo].copy_(masters[r][ci][a - r * s_len:b - r * s_len])
            fname = _file_name(slot["name"])
            atomic_torch_save(t.view(slot["shape"]), os.path.join(out_dir, fname))
            for alias in meta["aliases"][slot["name"]]:
                index[alias] = {"file": fname, "shape": slot["shape"], "dtype": "float32"}
            done += 1
            if progress:
                rate = done / max(time.perf_counter() - t0, 1e-9)
                print(f"\r[consolidate] {done}/{total} tensors, {rate:.1f}/s, ETA {(total - done) / rate:.0f}s",
                      end="", file=sys.stderr, flush=True)
    for kind in ("frozen", "buffers"):
        for name, t in meta[kind].items():
            fname = _file_name(name)
            atomic_torch_save(t.clone(), os.path.join(out_dir, fname))
            index[name] = {"file": fname, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if progress:
        print(file=sys.stderr)
    tmp = os.path.join(out_dir, f"index.json.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"tag": tag, "mp_rank": mp_rank, "global_steps": meta["global_steps"], "tensors": index}, f,
                  indent=1)
    os.replace(tmp, os.path.join(out_dir, "index.json"))
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
    index = consolidate(args.ckpt_dir, args.out_dir, args.tag, args.mp_rank, progress=True)
    print(f"[consolidate] wrote {len(index)} state-dict entries to {args.out_dir}")


if __name__ == "__main__":
    main()
