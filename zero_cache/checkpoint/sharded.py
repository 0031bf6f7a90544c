"""Per-rank shard files in DeepSpeed's layout; nothing is gathered onto one rank.

``<dir>/<tag>/zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``: the chunk layout (parameter names,
offsets, shapes, DP size) that consolidation needs, module buffers, frozen parameters and the caller's
``client_state``. ``..._optim_states.pt``: the training state (Adam's step count, the loss scaler). The fp32
master shards (model) and Adam moments (optim) go
- with ``save_large_model_multi_slice`` (default): into slice files next to them (``slices.py``), streamed
  from each state's tier ``save_large_model_slice_size`` elements at a time; the metadata file lists them;
- without: into the metadata file, one flat tensor per state (the rank's states in host memory at once).
Weights and optimizer states are separate so consolidation reads only the former. Every file is written
to a temp name and renamed, slices before the file listing them; ``<dir>/latest`` (the tag) is written by
global rank 0 after every rank has finished, so a crash mid-save leaves the previous checkpoint loadable.
Loading checks that every file is there before it changes anything, then writes each state back into
its own tier slice by slice.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import integrity
from .errors import CheckpointError
from .interface import EXP_AVG, EXP_AVG_SQ, PARAM, ShardedStateSource
from .names import LATEST, latest_path
from .slices import SliceFiles, atomic_torch_save, pieces, write_slices

FORMAT = "zero_cache/3"
# 1: no slices (a list of per-chunk tensors or one flat tensor); 1 and 2: the training state as separate fields.
READABLE = ("zero_cache/1", "zero_cache/2", FORMAT)
# Stream names in the files, and the state each holds.
MODEL_STATES, OPTIM_STATES = ("master",), ("exp_avg", "exp_avg_sq")
_STATE_OF = {"master": PARAM, "exp_avg": EXP_AVG, "exp_avg_sq": EXP_AVG_SQ}


def file_prefix(dp_rank: int, mp_rank: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}"


def is_sharded_checkpoint(tag_dir: str) -> bool:
    """Whether ``tag_dir`` holds this per-rank layout (rather than the distributed checkpoint)."""
    return os.path.isfile(os.path.join(tag_dir, file_prefix(0, 0) + "_model_states.pt"))


def latest_tag(load_dir: str) -> str:
    path = latest_path(load_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no '{path}': '{load_dir}' holds no complete zero_cache checkpoint "
                                f"(pass tag= explicitly or check the directory)")
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def write_latest(save_dir: str, tag: str) -> None:
    """``<save_dir>/latest`` names ``tag`` (atomic: written aside, then renamed)."""
    tmp = os.path.join(save_dir, f"{LATEST}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest_path(save_dir))


def layout_of(source: ShardedStateSource) -> list[dict]:
    return [{"index": p.index, "group": p.group, "resident": p.resident, "numel": p.numel, "padded": p.padded,
             "shard": p.shard, "slots": [{"name": s.name, "offset": s.offset, "numel": s.numel,
                                           "shape": list(s.shape)} for s in p.slots]}
            for p in source.chunk_plans()]


def flat(entry) -> torch.Tensor:
    """An unsliced state: one flat tensor (zero_cache/1 multi-slice files hold one tensor per chunk)."""
    return torch.cat(entry) if isinstance(entry, list) else entry


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _states(source: ShardedStateSource, prefix: str, kind: str, names: tuple[str, ...]) -> dict:
    """The entries of one kind's metadata file that hold (or list) the rank's streams of ``names``."""
    shards = [p.shard for p in source.chunk_plans()]

    def fill(name, ci, lo, hi, out):
        source.chunk_state(ci, _STATE_OF[name], lo, hi, out=out)

    slice_numel = source.slice_numel()
    if slice_numel is not None:
        return {"slices": write_slices(prefix, kind, names, shards, slice_numel, source.transfer_pool, fill)}
    out = {}
    for name in names:
        out[name] = torch.empty(sum(shards), dtype=torch.float32)
        for ci, a, b, pos in pieces(shards, 0, sum(shards)):
            fill(name, ci, a, b, out[name][pos:pos + b - a])
    return out


def save(source: ShardedStateSource, save_dir: str, tag: str, client_state: dict) -> str:
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    prefix = os.path.join(tag_dir, file_prefix(source.dp_rank, source.mp_rank))
    replicated = source.replicated_tensors()
    training = source.training_state()
    try:
        model_states = {
            "format": FORMAT, "dp_world_size": source.dp_size, "dp_rank": source.dp_rank,
            "mp_rank": source.mp_rank, "compute_dtype": str(source.compute_dtype), "layout": layout_of(source),
            "aliases": source.param_aliases(),
            **_states(source, prefix, "model", MODEL_STATES),
            "frozen": {n: t.detach().cpu().clone() for n, t in replicated.items()
                       if isinstance(t, torch.nn.Parameter)},
            "buffers": {n: t.detach().cpu().clone() for n, t in replicated.items()
                        if not isinstance(t, torch.nn.Parameter)},
            "global_steps": training["optimizer_step"], "client_state": client_state,
        }
        atomic_torch_save(model_states, prefix + "_model_states.pt")
        integrity.write_sidecar(prefix + "_model_states.pt")
        del model_states
        optim_states = {"format": FORMAT, **_states(source, prefix, "optim", OPTIM_STATES),
                        "training_state": training}
        atomic_torch_save(optim_states, prefix + "_optim_states.pt")
        integrity.write_sidecar(prefix + "_optim_states.pt")
    finally:
        source.transfer_pool.trim()
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_latest(save_dir, tag)
    _barrier()
    return tag_dir


def _read_metadata(path: str, tag_dir: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: checkpoint '{tag_dir}' is incomplete or was written with "
                                f"another parallel layout")
    integrity.verify_sidecar(path)  # files of formats 1 and 2 have none
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or damaged zip archive
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); it is truncated or corrupted: "
                              f"load an earlier tag") from None
    if not isinstance(saved, dict) or saved.get("format") not in READABLE:
        raise ValueError(f"{path}: not a zero_cache checkpoint (format "
                         f"{saved.get('format') if isinstance(saved, dict) else None!r}; readable: {READABLE})")
    return saved


def _check_layout(saved: dict, source: ShardedStateSource, path: str) -> None:
    if saved["dp_world_size"] != source.dp_size or saved["layout"] != layout_of(source):
        raise ValueError(
            f"{path}: saved with data-parallel size {saved['dp_world_size']} and a different chunk layout than this "
            f"run (data-parallel size {source.dp_size}); resume with the same model and zero_optimization "
            f"settings, or consolidate it (python -m zero_cache.checkpoint.consolidate) and load the state dict")


def _restore(source: ShardedStateSource, saved: dict, files: SliceFiles | None, names: tuple[str, ...]) -> None:
    """Write every piece of the streams of ``names`` into the source's chunks, in stream order."""
    shards = [p.shard for p in source.chunk_plans()]
    if files is None:
        values = {n: flat(saved[n]) for n in names}
        for ci, a, b, pos in pieces(shards, 0, sum(shards)):
            for n in names:
                source.set_chunk_state(ci, _STATE_OF[n], values[n][pos:pos + b - a], a)
        return
    for k in range(len(files)):
        data = files.load(k)
        lo, hi = files.bounds(k)
        for ci, a, b, pos in pieces(shards, lo, hi):
            for n in names:
                source.set_chunk_state(ci, _STATE_OF[n], data[n][pos:pos + b - a], a)
        del data  # unmapped before the next slice is mapped


def _training_state(opt: dict) -> dict:
    """The training state of an optimizer file (formats 1 and 2 kept it as separate fields)."""
    if "training_state" in opt:
        return opt["training_state"]
    scaler = opt["loss_scaler"]
    dynamic = {"scale": scaler["scale"], "growth_tracker": scaler["clean_steps"],
               "hysteresis_tracker": scaler["hysteresis_left"]}
    return {"optimizer_step": int(opt["step"][0]), "loss_scaler": dynamic, "lr": opt["optimizer"]["lr"]}


@torch.no_grad()
def load(source: ShardedStateSource, load_dir: str, tag: str | None, load_optimizer_states: bool
         ) -> tuple[str, dict]:
    tag = tag or latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    prefix = os.path.join(tag_dir, file_prefix(source.dp_rank, source.mp_rank))
    model_path, optim_path = prefix + "_model_states.pt", prefix + "_optim_states.pt"
    saved = _read_metadata(model_path, tag_dir)
    _check_layout(saved, source, model_path)
    opt = _read_metadata(optim_path, tag_dir) if load_optimizer_states else None
    files = {}
    for key, meta, path in (("model", saved, model_path), ("optim", opt, optim_path)):
        if meta is not None and "slices" in meta:
            files[key] = SliceFiles(tag_dir, path, meta["slices"])
            files[key].check_present()  # before any state is overwritten
    try:
        _restore(source, saved, files.get("model"), MODEL_STATES)
        replicated = source.replicated_tensors()
        for n, t in {**saved["frozen"], **saved["buffers"]}.items():
            replicated[n].copy_(t)
        if opt is not None:
            _restore(source, opt, files.get("optim"), OPTIM_STATES)
        source.load_training_state(_training_state(opt) if opt is not None else {}, opt is not None)
    finally:
        source.transfer_pool.trim()
    source.states_loaded()
    return tag_dir, saved["client_state"]
