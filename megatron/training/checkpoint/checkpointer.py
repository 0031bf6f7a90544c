"""The trainer's checkpoints in the distributed format: directories, the tracker, background saves, cleanup.

    <save>/latest_checkpointed_iteration.txt    the last complete iteration (written last, atomically)
    <save>/iter_0000100/                         one distributed checkpoint (zero_cache.checkpoint.distributed):
        .metadata, __<rank>_0.distcp, checksums.json

What a checkpoint holds beyond the model states: ``args`` (the run's Megatron-named arguments), ``iteration``,
``consumed_samples`` (the data position), ``opt_param_scheduler`` and every rank's RNG states
(``rng/tp<t>_pp<p>_dp<d>``, restored when the mesh is the same).

A background save (``--async-save``) writes while training goes on: nothing is copied, because the states it
reads change only in the optimizer step, and that step first waits for the save to finish
(``wait_before_update``). The next save and the end of training wait too. The tracker is written only after
every rank's files and the checksums are on disk, so a crash at any moment leaves the previous checkpoint
loadable; directories a crash left incomplete and temporary files are removed by the next save or load.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.training.checkpoint.background import BackgroundWork
from megatron.training.checkpoint.names import is_iteration_dirname, iteration_dir, tracker_path
from zero_cache.checkpoint import CheckpointError, distributed
from zero_cache.checkpoint.interface import StateSource

_TMP = re.compile(r"\.tmp\.\d+$")


def write_tracker(root: str, iteration: int) -> None:
    """Name ``iteration`` in the tracker (written aside, fsynced, renamed)."""
    path = tracker_path(root)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_tracker(root: str) -> int | None:
    """The iteration the tracker names; None when there is none."""
    path = tracker_path(root)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number but holds {text!r}; fix or delete it "
                              "(then the directory is treated as holding no checkpoint)")
    return int(text)


def check_writable(root: str) -> None:
    """``--save``'s directory exists (created if not) and takes new files: checked on every rank at start-up, so a
    wrong path stops the run before training rather than at its first save."""
    try:
        os.makedirs(root, exist_ok=True)
        # Unnamed where the OS allows (else a random name): another rank's remove_leftovers may be sweeping
        # this directory for *.tmp.<pid> files at the same moment.
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        raise CheckpointError(f"--save {root}: cannot write checkpoints there ({e.strerror or e}); give a writable "
                              f"directory") from None


def remove_leftovers(root: str) -> list[str]:
    """Remove what crashed saves left under ``root``: distributed checkpoint directories without their checksums
    file, and temporary files (``*.tmp.<pid>``) of any layout. Returns the removed paths. One rank calls it.
    The directory the tracker names is never removed: the tracker is written only after a save completes, so if
    that directory lacks its checksums they were lost later, and loading it reports the damage instead."""
    removed = []
    if not os.path.isdir(root):
        return removed
    try:
        tracked = read_tracker(root)
    except (CheckpointError, OSError, UnicodeDecodeError):
        tracked = None  # the load that follows reports a bad tracker
    keep = iteration_dir(root, tracked) if tracked is not None else None
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if is_iteration_dirname(name) and os.path.isdir(path) and path != keep:
            if distributed.is_started(path) and not distributed.is_checkpoint(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    for directory, _, names in os.walk(root):
        for f in names:
            if _TMP.search(f):
                os.remove(os.path.join(directory, f))
                removed.append(os.path.join(directory, f))
    return removed


@dataclass(frozen=True)
class SaveRecord:
    iteration: int
    blocked_s: float  # time the training loop was held by this save (the call, and any wait for it)
    write_s: float  # time from the call until every file and the tracker were on disk


class Checkpointer:
    """Saves distributed checkpoints of one run (collective over ``group``, every rank), one at a time."""

    def __init__(self, save_dir: str | None, *, async_save: bool, group, device: torch.device,
                 slice_numel: int = distributed.DEFAULT_SLICE_NUMEL):
        self.save_dir, self.async_save, self.group, self.device = save_dir, async_save, group, device
        self.slice_numel = slice_numel
        self._writer = BackgroundWork("checkpoint_writer", device)
        self._pending: dict | None = None  # the save in flight: iteration, start time, blocked seconds
        self.records: list[SaveRecord] = []

    # ---- saving --------------------------------------------------------------------------------------------
    def save(self, iteration: int, source: StateSource, layout, objects: dict[str, Any], *,
             optimizer: bool = True) -> None:
        """Write ``iteration``; returns at once under ``async_save`` (the files are written in the background)."""
        self.wait()
        directory = iteration_dir(self.save_dir, iteration)
        if distributed.is_checkpoint(directory):  # nothing changed since it was saved (no step ran)
            return
        start = time.perf_counter()
        if _rank() == 0:
            remove_leftovers(self.save_dir)
        _barrier(self.group)
        self._pending = {"iteration": iteration, "start": start, "blocked": 0.0}
        job = (directory, source, layout, objects, optimizer)
        if not self.async_save:
            self._write(*job)
            self._finish()
            return
        self._writer.start(self._write, *job)
        self._pending["blocked"] += time.perf_counter() - start

    def _write(self, directory, source, layout, objects, optimizer) -> None:
        distributed.save(directory, source, layout=layout, objects=objects, group=self.group,
                         slice_numel=self.slice_numel, optimizer=optimizer)
        if _rank() == 0:
            write_tracker(self.save_dir, self._pending["iteration"])
        _barrier(self.group)
        self._pending["written"] = time.perf_counter()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; its time counts as blocked."""
        if self._pending is None:
            return
        start = time.perf_counter()
        try:
            background = self._writer.join()
        except BaseException:
            self._pending = None
            raise
        if background:
            self._pending["blocked"] += time.perf_counter() - start
        self._finish()

    def wait_before_update(self) -> None:
        """Called before anything a save reads changes (the optimizer step)."""
        self.wait()

    def _finish(self) -> None:
        p, self._pending = self._pending, None
        if not self.async_save:
            p["blocked"] = time.perf_counter() - p["start"]
        record = SaveRecord(p["iteration"], p["blocked"], p["written"] - p["start"])
        self.records.append(record)
        if dist.get_rank() == 0:
            how = "in the background" if self.async_save else "synchronously"
            print(f"> saved checkpoint at iteration {record.iteration} to {self.save_dir} {how}: written in "
                  f"{record.write_s:.2f} s, training blocked {record.blocked_s:.2f} s", flush=True)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None


def load(directory: str, source: StateSource, layout, *, objects: list[str], optional: list[str],
         optimizer: bool, group, slice_numel: int = distributed.DEFAULT_SLICE_NUMEL, fetch=None) -> dict[str, Any]:
    """Read a distributed checkpoint into ``source`` (see zero_cache.checkpoint.distributed.load)."""
    return distributed.load(directory, source, layout=layout, objects=objects, optional_objects=optional,
                            optimizer=optimizer, group=group, slice_numel=slice_numel, fetch=fetch)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)
