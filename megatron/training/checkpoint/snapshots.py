"""Snapshots of the training state in host memory, copied to a peer on another host (Megatron's
``--non-persistent-ckpt-type local``; in the spirit of Gemini, SOSP 2023).

Every ``--non-persistent-save-interval`` iterations each rank writes its part of the distributed checkpoint
(the same global tensors as ``--save``: any mesh resumes from it) into its host's directory under
``--non-persistent-local-ckpt-dir``, meant to be a memory filesystem such as /dev/shm. With ``--replication``
each rank's file is then copied into the directory of a rank on another host (``--replication-jump`` ranks on;
default: the same local rank of the next host), and the checkpoint's metadata to every host. It happens in
the background on a group of its own; the next optimizer step waits for it, as for ``--async-save``.

    <local dir>/<host>/iter_0000100/   .metadata, checksums.json, this host's ranks' files, the copies it keeps
    <local dir>/<host>/iter_0000100/snapshot.json    which run and mesh wrote it (written last on the host)

A host keeps its newest snapshot; the one before is removed once the next is complete everywhere. On a start
with ``--load``, the ranks compare what their hosts hold: the newest snapshot of this run (same ``--save`` and
model) whose every file survives on some host, and which is at least as new as the checkpoint under --load,
is restored. Each rank receives the files its host lacks from the ranks that hold them; nothing is read from
storage. Files are verified against the checksums before they are read. When both copies of a file are
gone, the checkpoint under --load is read as before. A clean end of training removes the run's snapshots.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from megatron.training.checkpoint.background import BackgroundWork
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.names import is_iteration_dirname, iteration_dir, iteration_dirname
from zero_cache.checkpoint import CheckpointError, distributed, peer_files
from zero_cache.checkpoint.integrity import CHECKSUMS, read_checksums
from zero_cache.checkpoint.interface import StateSource

INFO = "snapshot.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def host_key() -> str:
    """This host's name and non-loopback IPv4 addresses (containers may share a name and a bridge's address, and
    the hosts of one machine's network namespaces share a name and a memory filesystem: not all addresses)."""
    addresses = sorted({a.address for nic in psutil.net_if_addrs().values() for a in nic
                        if a.family == socket.AF_INET and not a.address.startswith("127.")})
    return _UNSAFE.sub("_", "-".join([socket.gethostname(), *addresses]))


def run_id(save_dir: str, model_args: dict[str, Any]) -> str:
    """The run a snapshot belongs to: its checkpoint directory and its model."""
    text = json.dumps([os.path.abspath(save_dir), sorted(model_args.items())], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Found:
    iteration: int
    token: str  # which save of that iteration (a run that went back to an older snapshot saves it again)
    mesh: dict[str, Any]  # the mesh that wrote it (RNG states are restored on the same mesh only)


class PeerSnapshots:
    """Writes and finds this run's snapshots (collective over every rank; its own gloo group)."""

    def __init__(self, cfg: CheckpointConfig, run: str, mesh: dict[str, Any], device: torch.device,
                 timeout: datetime.timedelta):
        self.cfg, self.run, self.mesh = cfg, run, mesh
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.rank = dist.get_rank(self.group)
        self.host_keys = peer_files.all_gather(host_key(), self.group)
        hosts = peer_files.hosts_of(self.host_keys)
        self.first_on_host = hosts[self.host_keys[self.rank]][0] == self.rank
        self.root = os.path.join(cfg.non_persistent_local_ckpt_dir, self.host_keys[self.rank])
        self.replicas = (peer_files.replica_ranks(self.host_keys, cfg.replication_jump) if cfg.replication
                         else [None] * len(self.host_keys))
        self._writer = BackgroundWork("snapshot_writer", device)
        os.makedirs(self.root, exist_ok=True)

    @property
    def hosts(self) -> int:
        return len(set(self.host_keys))

    def due(self, iteration: int) -> bool:
        return iteration % self.cfg.non_persistent_save_interval == 0

    # ---- saving ----------------------------------------------------------------------------------------------
    def save(self, iteration: int, source: StateSource, layout, objects: dict[str, Any]) -> None:
        """Start writing the snapshot of ``iteration`` in the background (the previous one is finished first)."""
        self._writer.start(self._write, iteration, source, layout, objects, time.perf_counter())

    def _write(self, iteration: int, source: StateSource, layout, objects: dict[str, Any], start: float) -> None:
        directory = iteration_dir(self.root, iteration)
        if self.first_on_host:  # a snapshot of this iteration from an earlier round is not mixed with this one
            shutil.rmtree(directory, ignore_errors=True)
        dist.barrier(group=self.group)
        distributed.save(directory, source, layout=layout, objects=objects, group=self.group)
        # One all-gather: every rank's data files, and from rank 0 the metadata's sizes and this save's token.
        here = peer_files.listing(directory)
        mine = {n: size for n, size in here.items() if n.startswith(f"__{self.rank}_")}
        shared = ({n: here[n] for n in (distributed.METADATA, CHECKSUMS)}, uuid.uuid4().hex) if self.rank == 0 else None
        everyone = peer_files.all_gather((mine, shared), self.group)
        files = [f for f, _ in everyone]
        metadata, token = everyone[0][1]
        written = time.perf_counter()
        copies = self._copies(files, metadata)
        peer_files.copy_files(directory, copies, self.group)
        if self.first_on_host:
            _write_json(os.path.join(directory, INFO), {"run": self.run, "iteration": iteration, "token": token,
                                                        "mesh": self.mesh})
        dist.barrier(group=self.group)  # complete on every host: the older ones can go
        self._remove_iterations(keep=iteration)
        if self.rank == 0:
            mib = sum(size for f in files for size in f.values()) / 2**20
            copied = sum(t.nbytes for t in copies) / 2**20
            sent = (f"{copied:.1f} MiB copied to other hosts in {time.perf_counter() - written:.2f} s"
                    if self.hosts > 1 else "one host: no copies")
            print(f"> snapshot of iteration {iteration} in host memory: {mib:.1f} MiB written in "
                  f"{written - start:.2f} s, {sent}", flush=True)

    def _copies(self, files: list[dict[str, int]], metadata: dict[str, int]) -> list[peer_files.Transfer]:
        """Each rank's files to its replica; rank 0's metadata and checksums to every other host."""
        out = [peer_files.Transfer(name, rank, buddy, size) for rank, buddy in enumerate(self.replicas)
               if buddy is not None for name, size in sorted(files[rank].items())]
        for ranks in list(peer_files.hosts_of(self.host_keys).values())[1:]:
            out += [peer_files.Transfer(name, 0, ranks[0], size) for name, size in metadata.items()]
        return out

    def _remove_iterations(self, keep: int | None = None) -> None:
        """This host's snapshots other than ``keep`` (one rank per host does it)."""
        if not self.first_on_host:
            return
        for name in os.listdir(self.root):
            if is_iteration_dirname(name) and name != (iteration_dirname(keep) if keep is not None else None):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def wait(self) -> None:
        """Block until the snapshot in flight (if any) is complete."""
        self._writer.join()

    def remove_all(self) -> None:
        """The run ended cleanly (its checkpoint is saved): give the memory back."""
        self.wait()
        dist.barrier(group=self.group)
        self._remove_iterations()

    # ---- restoring -------------------------------------------------------------------------------------------
    def newest(self, not_older_than: int) -> Found | None:
        """The newest snapshot of this run, at least ``not_older_than``, whose every file some host still holds;
        None if there is none (the same answer on every rank)."""
        return newest_complete([e for inv in peer_files.all_gather(self._inventory(), self.group) for e in inv],
                               not_older_than)

    def _inventory(self) -> list[dict]:
        """This run's snapshots on this host: iteration, token, the files here, the files its checksums list (if
        held here), the mesh that wrote it."""
        out = []
        for name in sorted(os.listdir(self.root)):
            directory = os.path.join(self.root, name)
            info = _read_json(os.path.join(directory, INFO)) if is_iteration_dirname(name) else None
            if info is None or info.get("run") != self.run:
                continue
            files = peer_files.listing(directory)
            expected = None
            if CHECKSUMS in files:
                try:
                    expected = sorted(read_checksums(directory)["files"])
                except CheckpointError:  # a damaged checksums file: this host's copy does not count
                    files.pop(CHECKSUMS)
            out.append({"iteration": int(info["iteration"]), "token": info.get("token"), "files": sorted(files),
                        "expected": expected, "mesh": info["mesh"]})
        return out

    def restore(self, found: Found, load: Callable[[str, Callable[[list[str]], None]], Any]) -> Any:
        """Bring ``found``'s metadata to every host and ``load(directory, fetch)``, ``fetch`` receiving the files
        each rank reads and its host lacks; prints where the bytes came from."""
        directory = iteration_dir(self.root, found.iteration)
        start = time.perf_counter()
        info = _read_json(os.path.join(directory, INFO)) or {}
        if self.first_on_host and info.get("token") != found.token:  # another save of that iteration: not mixed
            shutil.rmtree(directory, ignore_errors=True)
        dist.barrier(group=self.group)
        received = peer_files.fetch_missing(directory, [distributed.METADATA, CHECKSUMS], self.host_keys,
                                            self.group)

        def fetch(names: list[str]) -> None:
            nonlocal received
            received += peer_files.fetch_missing(directory, names, self.host_keys, self.group)
        result = load(directory, fetch)
        total = torch.tensor([received], dtype=torch.int64)
        dist.all_reduce(total, group=self.group)
        if dist.get_rank() == 0:
            print(f"> restored iteration {found.iteration} from the in-memory snapshots of {self.hosts} host(s) in "
                  f"{time.perf_counter() - start:.2f} s: {total.item() / 2**20:.1f} MiB copied between hosts, "
                  f"nothing read from --load", flush=True)
        return result


def newest_complete(entries: list[dict], not_older_than: int) -> Found | None:
    """Of the hosts' inventories (``PeerSnapshots._inventory``), the newest save whose every file is held
    somewhere; a host's files of another save of the same iteration do not count."""
    for iteration, token in sorted({(e["iteration"], e["token"]) for e in entries}, reverse=True):
        if iteration < not_older_than:
            break
        same = [e for e in entries if (e["iteration"], e["token"]) == (iteration, token)]
        held = {n for e in same for n in e["files"]}
        expected = next((e["expected"] for e in same if e["expected"]), None)
        if expected is not None and set(expected) | {distributed.METADATA, CHECKSUMS} <= held:
            return Found(iteration, token, same[0]["mesh"])
    return None


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
