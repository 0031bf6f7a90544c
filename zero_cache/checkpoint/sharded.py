"""Per-rank shard files in DeepSpeed's layout; nothing is gathered onto one rank.

``<dir>/<tag>/zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``: this rank's fp32 master shards plus
the chunk layout (parameter names, offsets, shapes, DP size) that consolidation needs, module buffers and
the caller's ``client_state``. ``..._optim_states.pt``: Adam moments, step counts, loss-scaler state.
Weights and optimizer states are separate files so consolidation reads only the former. Each file is
written to a temp name and renamed; ``<dir>/latest`` (the tag) is written by global rank 0 after every
rank has finished. With ``save_large_model_multi_slice`` each chunk's shard is its own tensor entry
(no extra copy of the rank's states); without it they are concatenated into one flat tensor per kind.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

FORMAT = "zero_cache/1"


def file_prefix(dp_rank: int, mp_rank: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}"


def atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


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


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it owns its storage, else a copy (torch.save would write the whole base buffer)."""
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _pack(tensors: list[torch.Tensor], multi_slice: bool):
    return [_owned(t) for t in tensors] if multi_slice else torch.cat([t.reshape(-1) for t in tensors])


def unpack(entry, shards: list[int]) -> list[torch.Tensor]:
    if isinstance(entry, list):
        return entry
    return list(torch.split(entry, shards))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(engine, save_dir: str, tag: str, client_state: dict) -> str:
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    multi = engine.config.zero_optimization.save_large_model_multi_slice
    prefix = os.path.join(tag_dir, file_prefix(engine.dp_rank, engine.mp_rank))
    aliases = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    managed = {id(s.param) for c in engine.chunks for s in c.plan.slots}
    model_states = {
        "format": FORMAT, "dp_world_size": engine.comm.size, "dp_rank": engine.dp_rank, "mp_rank": engine.mp_rank,
        "stage": engine.config.zero_optimization.stage, "compute_dtype": str(engine.dtype),
        "layout": layout_of(engine),
        "aliases": {s.name: aliases[id(s.param)] for c in engine.chunks for s in c.plan.slots},
        "master": _pack([engine.state_tensor(c, "master") for c in engine.chunks], multi),
        "frozen": {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters() if id(p) not in managed},
        "buffers": {n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()},
        "global_steps": engine.global_steps, "client_state": client_state,
    }
    atomic_torch_save(model_states, prefix + "_model_states.pt")
    del model_states
    optim_states = {
        "format": FORMAT, "exp_avg": _pack([engine.state_tensor(c, "exp_avg") for c in engine.chunks], multi),
        "exp_avg_sq": _pack([engine.state_tensor(c, "exp_avg_sq") for c in engine.chunks], multi),
        "step": [c.step.detach().cpu().clone() for c in engine.chunks],
        "loss_scaler": engine.scaler.state_dict(), "optimizer": engine.optimizer.state_dict(),
    }
    atomic_torch_save(optim_states, prefix + "_optim_states.pt")
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = os.path.join(save_dir, f"latest.tmp.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(save_dir, "latest"))
    _barrier()
    return tag_dir


def _check_layout(saved: dict, engine, path: str) -> None:
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path}: not a zero_cache checkpoint (format {saved.get('format')!r})")
    if saved["dp_world_size"] != engine.comm.size or saved["layout"] != layout_of(engine):
        raise ValueError(
            f"{path}: saved with data-parallel size {saved['dp_world_size']} and a different chunk layout than this "
            f"run (data-parallel size {engine.comm.size}); resume with the same model and zero_optimization "
            f"settings, or consolidate it (python -m zero_cache.checkpoint.consolidate) and load the state dict")


@torch.no_grad()
def load(engine, load_dir: str, tag: str | None, load_optimizer_states: bool) -> tuple[str, dict]:
    tag = tag or latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    prefix = os.path.join(tag_dir, file_prefix(engine.dp_rank, engine.mp_rank))
    path = prefix + "_model_states.pt"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: checkpoint '{tag_dir}' is incomplete or was written with "
                                f"another parallel layout")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    _check_layout(saved, engine, path)
    shards = [c.plan.shard for c in engine.chunks]
    for c, m in zip(engine.chunks, unpack(saved["master"], shards)):
        engine.set_state_tensor(c, "master", m)
        if not c.master_is_param():
            engine.set_state_tensor(c, "param", m)
    params = dict(engine.module.named_parameters())
    for n, t in saved["frozen"].items():
        params[n].copy_(t)
    buffers = dict(engine.module.named_buffers())
    for n, t in saved["buffers"].items():
        buffers[n].copy_(t)
    engine.global_steps = saved["global_steps"]
    if load_optimizer_states:
        opt = torch.load(prefix + "_optim_states.pt", map_location="cpu", weights_only=True)
        for c, m, v, s in zip(engine.chunks, unpack(opt["exp_avg"], shards), unpack(opt["exp_avg_sq"], shards),
                              opt["step"]):
            engine.set_state_tensor(c, "exp_avg", m)
            engine.set_state_tensor(c, "exp_avg_sq", v)
            c.step.copy_(s)
        engine.scaler.load_state_dict(opt["loss_scaler"])
        engine.optimizer.lr = opt["optimizer"]["lr"]
    engine.refresh_resident_params()
    return tag_dir, saved["client_state"]
