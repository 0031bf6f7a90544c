"""Per-rank shard files in DeepSpeed's layout; nothing is gathered onto one rank.

``<dir>/<tag>/zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``: the chunk layout (parameter names,
offsets, shapes, DP size) that consolidation needs, module buffers, frozen parameters and the caller's
``client_state``. ``..._optim_states.pt``: Adam step counts, loss-scaler and optimizer state. The fp32
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

from .slices import CheckpointError, SliceFiles, atomic_torch_save, pieces, write_slices

FORMAT = "zero_cache/2"
READABLE = ("zero_cache/1", "zero_cache/2")  # 1: no slices; a list of per-chunk tensors or one flat tensor
MODEL_STATES, OPTIM_STATES = ("master",), ("exp_avg", "exp_avg_sq")


def file_prefix(dp_rank: int, mp_rank: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}"


def latest_tag(load_dir: str) -> str:
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no '{path}': '{load_dir}' holds no complete zero_cache checkpoint "
                                f"(pass tag= explicitly or check the directory)")
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def layout_of(engine) -> list[dict]:
    return [{"index": c.plan.index, "group": c.plan.group, "resident": c.plan.resident, "numel": c.plan.numel,
             "padded": c.plan.padded, "shard": c.plan.shard,
             "slots": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                       for s in c.plan.slots]} for c in engine.chunks]


def flat(entry) -> torch.Tensor:
    """An unsliced state: one flat tensor (zero_cache/1 multi-slice files hold one tensor per chunk)."""
    return torch.cat(entry) if isinstance(entry, list) else entry


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _states(engine, prefix: str, kind: str, names: tuple[str, ...]) -> dict:
    """The entries of one kind's metadata file that hold (or list) the rank's streams of ``names``."""
    z = engine.config.zero_optimization
    shards = [c.plan.shard for c in engine.chunks]

    def fill(name, ci, lo, hi, out):
        engine.state_tensor(engine.chunks[ci], name, lo, hi, out=out)

    if z.save_large_model_multi_slice:
        return {"slices": write_slices(prefix, kind, names, shards, z.save_large_model_slice_size,
                                       engine.store.transfer_pool, fill)}
    out = {}
    for name in names:
        out[name] = torch.empty(sum(shards), dtype=torch.float32)
        for ci, a, b, pos in pieces(shards, 0, sum(shards)):
            fill(name, ci, a, b, out[name][pos:pos + b - a])
    return out


def save(engine, save_dir: str, tag: str, client_state: dict) -> str:
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    prefix = os.path.join(tag_dir, file_prefix(engine.dp_rank, engine.mp_rank))
    aliases = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    managed = {id(s.param) for c in engine.chunks for s in c.plan.slots}
    try:
        model_states = {
            "format": FORMAT, "dp_world_size": engine.comm.size, "dp_rank": engine.dp_rank,
            "mp_rank": engine.mp_rank, "stage": engine.config.zero_optimization.stage,
            "compute_dtype": str(engine.dtype), "layout": layout_of(engine),
            "aliases": {s.name: aliases[id(s.param)] for c in engine.chunks for s in c.plan.slots},
            **_states(engine, prefix, "model", MODEL_STATES),
            "frozen": {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()
                       if id(p) not in managed},
            "buffers": {n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()},
            "global_steps": engine.global_steps, "client_state": client_state,
        }
        atomic_torch_save(model_states, prefix + "_model_states.pt")
        del model_states
        optim_states = {
            "format": FORMAT, **_states(engine, prefix, "optim", OPTIM_STATES),
            "step": [c.step.detach().cpu().clone() for c in engine.chunks],
            "loss_scaler": engine.scaler.state_dict(), "optimizer": engine.optimizer.state_dict(),
        }
        atomic_torch_save(optim_states, prefix + "_optim_states.pt")
    finally:
        engine.store.transfer_pool.trim()
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = os.path.join(save_dir, f"latest.tmp.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(save_dir, "latest"))
    _barrier()
    return tag_dir


def _read_metadata(path: str, tag_dir: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: checkpoint '{tag_dir}' is incomplete or was written with "
                                f"another parallel layout")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or damaged zip archive
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); it is truncated or corrupted: "
                              f"load an earlier tag") from None
    if not isinstance(saved, dict) or saved.get("format") not in READABLE:
        raise ValueError(f"{path}: not a zero_cache checkpoint (format "
                         f"{saved.get('format') if isinstance(saved, dict) else None!r}; readable: {READABLE})")
    return saved


def _check_layout(saved: dict, engine, path: str) -> None:
    if saved["dp_world_size"] != engine.comm.size or saved["layout"] != layout_of(engine):
        raise ValueError(
            f"{path}: saved with data-parallel size {saved['dp_world_size']} and a different chunk layout than this "
            f"run (data-parallel size {engine.comm.size}); resume with the same model and zero_optimization "
            f"settings, or consolidate it (python -m zero_cache.checkpoint.consolidate) and load the state dict")


def _restore(engine, saved: dict, source: SliceFiles | None, names: tuple[str, ...], put) -> None:
    """Hand every piece of the streams of ``names`` to ``put(name, chunk, lo, values)``, in stream order."""
    shards = [c.plan.shard for c in engine.chunks]
    if source is None:
        values = {n: flat(saved[n]) for n in names}
        for ci, a, b, pos in pieces(shards, 0, sum(shards)):
            for n in names:
                put(n, engine.chunks[ci], a, values[n][pos:pos + b - a])
        return
    for k in range(len(source)):
        data = source.load(k)
        lo, hi = source.bounds(k)
        for ci, a, b, pos in pieces(shards, lo, hi):
            for n in names:
                put(n, engine.chunks[ci], a, data[n][pos:pos + b - a])
        del data  # unmapped before the next slice is mapped


@torch.no_grad()
def load(engine, load_dir: str, tag: str | None, load_optimizer_states: bool) -> tuple[str, dict]:
    tag = tag or latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    prefix = os.path.join(tag_dir, file_prefix(engine.dp_rank, engine.mp_rank))
    model_path, optim_path = prefix + "_model_states.pt", prefix + "_optim_states.pt"
    saved = _read_metadata(model_path, tag_dir)
    _check_layout(saved, engine, model_path)
    opt = _read_metadata(optim_path, tag_dir) if load_optimizer_states else None
    sources = {}
    for key, meta, path in (("model", saved, model_path), ("optim", opt, optim_path)):
        if meta is not None and "slices" in meta:
            sources[key] = SliceFiles(tag_dir, path, meta["slices"])
            sources[key].check_present()  # before any state is overwritten

    def put_master(_, chunk, lo, values):
        engine.set_state_tensor(chunk, "master", values, lo)
        if not chunk.master_is_param():
            engine.set_state_tensor(chunk, "param", values, lo)

    try:
        _restore(engine, saved, sources.get("model"), MODEL_STATES, put_master)
        params = dict(engine.module.named_parameters())
        for n, t in saved["frozen"].items():
            params[n].copy_(t)
        buffers = dict(engine.module.named_buffers())
        for n, t in saved["buffers"].items():
            buffers[n].copy_(t)
        engine.global_steps = saved["global_steps"]
        if opt is not None:
            _restore(engine, opt, sources.get("optim"), OPTIM_STATES,
                     lambda name, chunk, lo, values: engine.set_state_tensor(chunk, name, values, lo))
            for c, s in zip(engine.chunks, opt["step"]):
                c.step.copy_(s)
            engine.scaler.load_state_dict(opt["loss_scaler"])
            engine.optimizer.lr = opt["optimizer"]["lr"]
    finally:
        engine.store.transfer_pool.trim()
    engine.params_changed()
    return tag_dir, saved["client_state"]
