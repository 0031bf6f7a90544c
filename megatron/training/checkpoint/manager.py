"""The training loop's checkpoints: what a checkpoint holds besides the model states, which format, resume.

Saving (``--ckpt-format torch_dist``, the default) writes the backend's states as global tensors (any mesh,
ZeRO stage or tier placement resumes from them) plus ``args``, ``iteration``, ``consumed_samples``,
``opt_param_scheduler`` and every rank's RNG states (see ``checkpointer.py``). ``--ckpt-format torch`` keeps
the per-rank legacy layouts. Loading finds the format of the iteration the tracker names: a distributed
checkpoint is resharded onto this run; a legacy one must match its mesh. A model that differs from the saved
one (shape, block design) is one error naming the flags on both sides; RNG states are restored only on the
mesh that saved them (with dropout, another mesh draws other masks anyway).
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.training.checkpoint import checkpointer, names
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.rng import get_rng_state, set_rng_state, to_plain
from megatron.training.checkpoint.snapshots import PeerSnapshots, run_id
from zero_cache.checkpoint import CheckpointError, distributed
from zero_cache.checkpoint.names import default_tag

logger = logging.getLogger(__name__)

# Saved and loading runs must agree on these to be the same model; (argument, flag).
MODEL_KEYS = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
              ("ffn_hidden_size", "--ffn-hidden-size"), ("num_attention_heads", "--num-attention-heads"),
              ("num_query_groups", "--num-query-groups"), ("kv_channels", "--kv-channels"),
              ("position_embedding_type", "--position-embedding-type"), ("normalization", "--normalization"),
              ("swiglu", "--swiglu"), ("openai_gelu", "--openai-gelu"), ("add_bias_linear", "--disable-bias-linear"),
              ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"))
MESH_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
             "context_parallel_size")


def rng_key() -> str:
    """This rank's RNG states in a checkpoint (the context-parallel rank only where there is one)."""
    cp = f"_cp{ps.get_context_parallel_rank()}" if ps.get_context_parallel_world_size() > 1 else ""
    return (f"rng/tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}"
            f"_dp{ps.get_data_parallel_rank()}{cp}")


def check_same_model(saved: dict, ours: dict, where: str) -> None:
    """One error naming every model flag that differs between a checkpoint's args and this run's."""
    diffs = [f"{flag} {saved[key]!r} in the checkpoint, {ours[key]!r} in this run" for key, flag in MODEL_KEYS
             if key in saved and key in ours and saved[key] != ours[key]]
    if ours.get("position_embedding_type") == "learned_absolute" and \
            saved.get("max_position_embeddings", ours["max_position_embeddings"]) != ours["max_position_embeddings"]:
        diffs.append(f"--max-position-embeddings {saved['max_position_embeddings']} in the checkpoint, "
                     f"{ours['max_position_embeddings']} in this run")
    if diffs:
        raise CheckpointError(f"{where} holds another model: {'; '.join(diffs)}; train it with the model flags it "
                              f"was saved with")


class CheckpointManager:
    """Saves and resumes one run; the backend provides its states, layout and legacy format."""

    def __init__(self, cfg: CheckpointConfig, backend, scheduler, rng_tracker, args: dict[str, Any],
                 device: torch.device, timeout: datetime.timedelta):
        self.cfg, self.backend, self.scheduler, self.rng_tracker = cfg, backend, scheduler, rng_tracker
        self.args = to_plain(dict(args), "args")
        # DCP's collectives (and a background save) run on their own host group, apart from training's.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self.saver = checkpointer.Checkpointer(cfg.save, async_save=cfg.async_save, group=self.group, device=device)
        self.last_save = time.monotonic()
        if cfg.save:  # at start-up, not at the first save after training
            checkpointer.check_writable(cfg.save)
        self.snapshots = None
        if cfg.snapshots and dist.is_initialized():
            model = {key: self.args.get(key) for key, _ in MODEL_KEYS}
            self.snapshots = PeerSnapshots(cfg, run_id(cfg.save, model), {k: self.args.get(k) for k in MESH_KEYS},
                                           device, timeout)

    # ---- saving ----------------------------------------------------------------------------------------------
    def save(self, iteration: int, consumed_samples: int) -> None:
        """Save ``iteration`` (collective); under --async-save the files are written in the background."""
        self.last_save = time.monotonic()
        if self.cfg.ckpt_format == "torch":
            start = time.perf_counter()
            self.backend.save_legacy_checkpoint(self.cfg, iteration, self.scheduler,
                                                consumed_samples=consumed_samples, args=self.args,
                                                rng_tracker=self.rng_tracker)
            if dist.get_rank() == 0:
                print(f"> saved checkpoint at iteration {iteration} to {self.cfg.save} in "
                      f"{time.perf_counter() - start:.2f} s", flush=True)
            return
        optimizer = not self.cfg.no_save_optim
        self.saver.save(iteration, self.backend.checkpoint_states(), self.backend.checkpoint_layout(),
                        self._objects(iteration, consumed_samples, optimizer), optimizer=optimizer)

    def snapshot_due(self, iteration: int) -> bool:
        return self.snapshots is not None and self.snapshots.due(iteration)

    def save_snapshot(self, iteration: int, consumed_samples: int) -> None:
        """Start the in-memory snapshot of ``iteration`` (every state, in the background; see snapshots.py)."""
        self.snapshots.save(iteration, self.backend.checkpoint_states(), self.backend.checkpoint_layout(),
                            self._objects(iteration, consumed_samples, optimizer=True))

    def _objects(self, iteration: int, consumed_samples: int, optimizer: bool) -> dict[str, Any]:
        objects = {"args": self.args, "iteration": iteration, "consumed_samples": consumed_samples,
                   rng_key(): to_plain(get_rng_state(self.rng_tracker), "rng_state")}
        if optimizer:
            objects["opt_param_scheduler"] = to_plain(self.scheduler.state_dict(), "scheduler state")
        return objects

    def wait_before_update(self) -> None:
        """The optimizer step is about to change the states a background save reads: let it finish."""
        self.saver.wait_before_update()
        if self.snapshots is not None:
            self.snapshots.wait()

    def finish(self) -> None:
        """End of training: the last save is complete on return, and the snapshots it makes redundant gone."""
        self.saver.wait()
        if self.snapshots is not None:
            self.snapshots.remove_all()

    def minutes_since_save(self) -> float:
        return (time.monotonic() - self.last_save) / 60.0

    # ---- loading ---------------------------------------------------------------------------------------------
    def load(self) -> tuple[int, int]:
        """Resume from the latest checkpoint under --load: (iteration, consumed samples); (0, 0) without one or
        with --finetune."""
        cfg = self.cfg
        if not cfg.load:
            return 0, 0
        if os.path.exists(cfg.load) and not os.path.isdir(cfg.load):
            raise CheckpointError(f"--load {cfg.load} is a file; give the checkpoint directory (the one holding "
                                  f"{names.TRACKER})")
        if dist.get_rank() == 0:
            checkpointer.remove_leftovers(cfg.load)
        if dist.is_initialized():
            dist.barrier(group=self.group)
        iteration = checkpointer.read_tracker(cfg.load)
        if self.snapshots is not None and not cfg.finetune:
            found = self.snapshots.newest(not_older_than=iteration or 0)
            try:
                if found is not None:
                    return self.snapshots.restore(found, lambda directory, fetch: self._load_distributed(
                        directory, saved_mesh=found.mesh, fetch=fetch))
            except CheckpointError as e:  # every rank agreed before any state was read: none was changed
                if dist.get_rank() == 0:
                    print(f"> the in-memory snapshot of iteration {found.iteration} cannot be restored ({e}); "
                          f"reading --load {cfg.load} instead", flush=True)
        if iteration is None:
            if dist.get_rank() == 0:
                print(f"> --load {cfg.load}: no {names.TRACKER} there, starting from scratch at iteration 0",
                      flush=True)
            return 0, 0
        start = time.perf_counter()
        directory = names.iteration_dir(cfg.load, iteration)
        if distributed.is_started(directory):  # complete or not: an incomplete one fails naming what is missing
            it, consumed = self._load_distributed(directory)
        else:  # a legacy layout: the backend's own (or a clear error naming what is missing)
            it, consumed = self.backend.load_legacy_checkpoint(cfg, iteration, self.scheduler, self.rng_tracker)
        if dist.get_rank() == 0:
            where = directory if os.path.isdir(directory) else os.path.join(cfg.load, default_tag(iteration))
            print(f"> loaded checkpoint {where} in {time.perf_counter() - start:.2f} s (resuming at iteration {it}, "
                  f"{consumed} consumed samples)", flush=True)
        return it, consumed

    def _load_distributed(self, directory: str, saved_mesh: dict | None = None, fetch=None) -> tuple[int, int]:
        """Read ``directory``; a snapshot (``saved_mesh`` given) is this run's model already, and its files may
        have to be fetched from other hosts (``fetch``)."""
        cfg = self.cfg
        if saved_mesh is None:
            saved_args = distributed.load_objects(directory, ["args"])["args"]
            check_same_model(saved_args, self.args, directory)
            # Checkpoints from before context parallelism have no context_parallel_size: they had none.
            saved_mesh = {"context_parallel_size": 1, **saved_args}
        optimizer = not (cfg.no_load_optim or cfg.finetune)
        want_rng = not (cfg.no_load_rng or cfg.finetune)
        same_mesh = all(saved_mesh.get(k) == self.args.get(k) for k in MESH_KEYS)
        objects = ["iteration", "consumed_samples"] + (["opt_param_scheduler"] if optimizer else [])
        optional = [rng_key()] if want_rng and same_mesh else []
        loaded = checkpointer.load(directory, self.backend.checkpoint_states(), self.backend.checkpoint_layout(),
                                   objects=objects, optional=optional, optimizer=optimizer, group=self.group,
                                   fetch=fetch)
        if optimizer:
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        if want_rng and rng_key() in loaded:
            set_rng_state(loaded[rng_key()], self.rng_tracker)
        elif want_rng and dist.get_rank() == 0:
            mesh = ", ".join(f"{k.split('_')[0]} {saved_mesh.get(k)} -> {self.args.get(k)}" for k in MESH_KEYS)
            logger.warning("checkpoint %s was saved on another mesh (%s): RNG states start fresh", directory, mesh)
        if cfg.finetune:
            return 0, 0
        return int(loaded["iteration"]), int(loaded["consumed_samples"])
