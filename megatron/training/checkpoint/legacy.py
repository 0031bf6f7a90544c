"""Save and load training checkpoints in Megatron-LM's layout.

    <save>/latest_checkpointed_iteration.txt          the last complete iteration (written last)
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt       PP = 1, one file per tensor-parallel rank
    <save>/iter_0000100/mp_rank_00_000/model_optim_rng.pt   PP > 1, one file per (tp, pp) rank

Data-parallel rank 0 of each (tp, pp) writes; context-parallel ranks hold the same
weights and count as data-parallel peers here, as in Megatron-LM. The RNG states of
all those peers go into the file as a list so each restores its own. With the
interleaved schedule a file holds one state dict per model chunk, ``model0``,
``model1``, ... (chunk k of stage r is the (k x PP + r)-th slice of the layers), in
place of ``model``. Files
hold only tensors and plain Python values, so they load with
``torch.load(..., weights_only=True)``. Each file is written to a temporary name
and renamed; the tracker file is renamed into place only after every rank has
written, so a crash mid-save leaves the previous checkpoint as the one loaded.
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.training.checkpoint.checkpointer import read_tracker, write_tracker
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.names import TRACKER, iteration_dir, tracker_path
from megatron.training.checkpoint.rng import get_rng_state, set_rng_state, to_plain
from zero_cache.checkpoint import CheckpointError, disk_space, integrity

CHECKPOINT_VERSION = 3.0
MODEL_FILENAME = "model_optim_rng.pt"
_MP_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


# ----- paths -----
def mp_rank_dirname(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_file(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(iteration_dir(root, iteration), mp_rank_dirname(tp_rank, pp_rank, pp_size), MODEL_FILENAME)


def saved_mesh(root: str, iteration: int) -> tuple[int, int]:
    """(TP, PP) of a saved iteration, read from its ``mp_rank_*`` directory names."""
    it_dir = iteration_dir(root, iteration)
    if not os.path.isdir(it_dir):
        raise CheckpointError(f"{tracker_path(root)} names iteration {iteration} but {it_dir} does not exist; "
                              "restore that directory or point the tracker at an iteration that exists")
    ranks = [m for m in (_MP_DIR.match(n) for n in os.listdir(it_dir)) if m]
    if not ranks:
        raise CheckpointError(f"{it_dir} holds no mp_rank_* directories; the checkpoint is incomplete")
    tp = 1 + max(int(m.group(1)) for m in ranks)
    pp = 1 + max(int(m.group(2) or 0) for m in ranks)
    return tp, pp


def write_atomic(obj: Any, path: str) -> None:
    """torch.save to ``path`` via a temporary file in the same directory and an atomic rename; its checksum
    goes beside it (``integrity.write_sidecar``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        if disk_space.is_no_space(e):
            raise disk_space.no_space_error(path) from None
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    integrity.write_sidecar(path)


def load_file(path: str, *, mmap: bool = False) -> dict:
    """Load one checkpoint file on the CPU with weights_only=True; a clear error if it is missing or corrupt."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist; the checkpoint is incomplete "
                              "(was it saved with a different tensor/pipeline-parallel size?)")
    integrity.verify_sidecar(path)  # files written before checksums were recorded have none
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises several types for truncated / foreign files
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}: {e}); the file is "
                              "corrupt or not a checkpoint: restore it or load an earlier iteration") from e


# ----- mesh -----
@dataclass(frozen=True)
class _Mesh:
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    dp_ranks: tuple[int, ...]  # global ranks of the data x context-parallel peers, in their rank order
    dp_rank: int

    @property
    def dp(self) -> int:
        return len(self.dp_ranks)


def _mesh() -> _Mesh:
    if ps.model_parallel_is_initialized():
        return _Mesh(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                     ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                     tuple(ps.get_data_parallel_global_ranks(with_context_parallel=True)),
                     ps.get_data_parallel_rank(with_context_parallel=True))
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("checkpointing with several ranks needs initialize_model_parallel() first")
    return _Mesh(1, 1, 0, 0, (0,), 0)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip data-parallel wrappers (``.module``) so keys are the model's own names."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _gather_dp_rng_states(mesh: _Mesh, rng_tracker) -> list[dict]:
    """Every rank's RNG state, gathered over the world; returns those of this rank's data-parallel peers."""
    mine = get_rng_state(rng_tracker)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [everyone[r] for r in mesh.dp_ranks]


def model_keys(state: dict) -> list[str]:
    """The keys of a file's model state dicts: ``["model"]``, or ``model0``, ``model1``, ... (one per chunk of
    the interleaved schedule)."""
    if "model" in state:
        return ["model"]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if keys != [f"model{k}" for k in range(len(keys))] or not keys:
        raise CheckpointError(f"a checkpoint file holds model states {keys or 'none'}: expected 'model' or "
                              "'model0', 'model1', ...; the file is not a Megatron checkpoint")
    return keys


def _chunks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The model chunks of this stage: a model is its only chunk; a list (the interleaved schedule's) as given."""
    return [_unwrap(m) for m in model] if isinstance(model, Sequence) else [_unwrap(model)]


def _model_states(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[str, dict]:
    chunks = _chunks(model)
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict()}
    return {f"model{k}": chunk.state_dict() for k, chunk in enumerate(chunks)}


# ----- save / load -----
def save_checkpoint(cfg: CheckpointConfig, iteration: int, model: torch.nn.Module | Sequence[torch.nn.Module],
                    optimizer, scheduler, *, consumed_samples: int, args: dict, rng_tracker=None) -> str:
    """Write ``<save>/iter_<iteration, 7 digits>`` for this rank's (tp, pp) and update the tracker. ``model``:
    the stage's model, or the list of its model chunks (the interleaved schedule), as Megatron-LM takes it.

    All ranks must call it.

    ``optimizer.state_dict()`` and ``scheduler.state_dict()`` are called on every rank (they may be
    collective); only data-parallel rank 0 of each (tp, pp) writes. Returns the iteration directory.
    """
    if not cfg.save:
        raise CheckpointError("save_checkpoint() needs a directory: pass --save DIR")
    mesh = _mesh()
    state: dict[str, Any] = {
        "args": to_plain(dict(args), "args"),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(iteration),
        "consumed_samples": int(consumed_samples),
        **_model_states(model),
    }
    if not cfg.no_save_optim:
        if optimizer is not None:
            state["optimizer"] = to_plain(optimizer.state_dict(), "optimizer state")
        if scheduler is not None:
            state["opt_param_scheduler"] = to_plain(scheduler.state_dict(), "scheduler state")
    state["rng_state"] = to_plain(_gather_dp_rng_states(mesh, rng_tracker), "rng_state")
    if mesh.dp_rank == 0:
        write_atomic(state, checkpoint_file(cfg.save, iteration, mesh.tp_rank, mesh.pp_rank, mesh.pp))
    _barrier()  # every file is in place before the tracker names this iteration
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_tracker(cfg.save, iteration)
    _barrier()  # nobody reads or prunes checkpoints before the tracker is updated
    return iteration_dir(cfg.save, iteration)


def _check_mesh(root: str, iteration: int, mesh: _Mesh) -> None:
    tp, pp = saved_mesh(root, iteration)
    if (tp, pp) == (mesh.tp, mesh.pp):
        return
    saved = load_file(checkpoint_file(root, iteration, 0, 0, pp), mmap=True).get("args", {})
    tp = saved.get("tensor_model_parallel_size", tp)
    pp = saved.get("pipeline_model_parallel_size", pp)
    raise CheckpointError(
        f"checkpoint {iteration_dir(root, iteration)} was saved with tensor-parallel size {tp} and "
        f"pipeline-parallel size {pp}, but this run uses {mesh.tp} and {mesh.pp}: relaunch with "
        f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} (any data- or context-parallel "
        "size works with --no-load-rng), or export the weights with tools/checkpoint/convert_to_hf.py")


def load_checkpoint(cfg: CheckpointConfig, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer, scheduler,
                    rng_tracker=None) -> tuple[int, int]:
    """Restore the checkpoint named by ``<load>/latest_checkpointed_iteration.txt`` into ``model`` (a model or the
    list of its chunks, as ``save_checkpoint`` takes it).

    Returns (iteration, consumed_samples); (0, 0) when there is nothing to load or with --finetune.
    """
    if not cfg.load:
        return 0, 0
    iteration = read_tracker(cfg.load)
    if iteration is None:
        print(f"> --load {cfg.load}: no {TRACKER} there, starting from scratch at iteration 0", flush=True)
        return 0, 0
    mesh = _mesh()
    _check_mesh(cfg.load, iteration, mesh)
    path = checkpoint_file(cfg.load, iteration, mesh.tp_rank, mesh.pp_rank, mesh.pp)
    state = load_file(path)
    chunks, keys = _chunks(model), model_keys(state)
    if len(keys) != len(chunks):
        raise CheckpointError(f"{path} holds {len(keys)} model chunk(s) per pipeline stage but this run has "
                              f"{len(chunks)}: relaunch with --virtual-pipeline-model-parallel-size {len(keys)} "
                              "(1: without it), as it was saved")
    for key, chunk in zip(keys, chunks):
        try:
            chunk.load_state_dict(state[key], strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"the model in {path} does not fit this model ({e}); load it with the model "
                                  "arguments it was saved with (see its 'args')") from e

    if optimizer is not None and not (cfg.no_load_optim or cfg.finetune):
        if "optimizer" not in state:
            raise CheckpointError(f"{path} has no optimizer state (saved with --no-save-optim); "
                                  "pass --no-load-optim or --finetune")
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and not (cfg.no_load_optim or cfg.finetune):
        if "opt_param_scheduler" not in state:
            raise CheckpointError(f"{path} has no scheduler state (saved with --no-save-optim); "
                                  "pass --no-load-optim or --finetune")
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if not (cfg.no_load_rng or cfg.finetune):
        states = state["rng_state"]
        if len(states) != mesh.dp:
            raise CheckpointError(f"{path} holds RNG states of {len(states)} data x context-parallel ranks but "
                                  f"this run has {mesh.dp}; pass --no-load-rng to resume with fresh RNG states")
        set_rng_state(states[mesh.dp_rank], rng_tracker)

    if cfg.finetune:
        iteration, consumed = 0, 0
    else:
        iteration, consumed = int(state["iteration"]), int(state["consumed_samples"])
    return iteration, consumed
