"""Files of a checkpoint directory copied from rank to rank over a process group (no shared filesystem).

Used by checkpoints kept in each host's memory (a tmpfs such as /dev/shm): each host has its own directory,
a rank's files are copied to a rank on another host when written, and a rank that must read a file its host
does not hold receives it from a rank that does. Every rank calls each function with the same arguments'
shapes (collective over ``group``); the plans are computed from all-gathered inventories, so every rank
derives the same transfers and the same errors.

Transfers run in rounds in which a rank sends at most one file and receives at most one, each in pieces of
``PIECE`` bytes, so a copy holds one piece in memory however large the file. A received file is written
aside and renamed into place: a copy cut short by a failure is never seen under its name (and the
checkpoint's checksums catch one damaged later).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import CheckpointError

PIECE = 64 << 20


@dataclass(frozen=True)
class Transfer:
    name: str  # file name inside the directory
    sender: int  # group ranks
    receiver: int
    nbytes: int


def listing(directory: str) -> dict[str, int]:
    """{file name: size} of the finished files in ``directory`` (nothing when it does not exist)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    return {n: os.path.getsize(os.path.join(directory, n)) for n in names
            if ".tmp." not in n and os.path.isfile(os.path.join(directory, n))}


def all_gather(value, group) -> list:
    """``value`` of every rank of ``group``, in group-rank order."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def hosts_of(host_keys: list[str]) -> dict[str, list[int]]:
    """{host key: its group ranks, ascending}, hosts in the order of their first rank."""
    hosts: dict[str, list[int]] = {}
    for rank, key in enumerate(host_keys):
        hosts.setdefault(key, []).append(rank)
    return hosts


def replica_ranks(host_keys: list[str], jump: int | None = None) -> list[int | None]:
    """The rank that keeps a copy of each rank's files: ``jump`` ranks further on (default: the number of
    ranks on the first host, so the same local rank of the next host), moved on by whole hosts until it is on
    another host; None where every rank is on one host."""
    n = len(host_keys)
    if len(set(host_keys)) < 2:
        return [None] * n
    step = jump or len(hosts_of(host_keys)[host_keys[0]])
    out = []
    for rank in range(n):
        tries = [(rank + step * k) % n for k in range(1, n + 1)] + [(rank + k) % n for k in range(1, n)]
        out.append(next(r for r in tries if host_keys[r] != host_keys[rank]))
    return out


def plan_fetch(needed: list[list[str]], held: list[dict[str, int]], host_keys: list[str]) -> list[Transfer]:
    """The copies that give every host the files its ranks need: one receiver per host and file (its lowest
    rank that needs it), sent by the holder that has sent the least so far. A file no rank holds is one
    ``CheckpointError`` naming it (the same on every rank)."""
    transfers, load = [], [0] * len(host_keys)
    for _, ranks in hosts_of(host_keys).items():
        here = {n for r in ranks for n in held[r]}
        wanted: dict[str, int] = {}
        for r in ranks:
            for name in needed[r]:
                if name not in here:
                    wanted.setdefault(name, r)
        for name, receiver in sorted(wanted.items()):
            holders = [r for r in range(len(host_keys)) if name in held[r]]
            if not holders:
                raise CheckpointError(f"{name} is held by no rank: its host and the host keeping its copy are "
                                      f"both gone")
            sender = min(holders, key=lambda r: (load[r], r))
            load[sender] += 1
            transfers.append(Transfer(name, sender, receiver, held[sender][name]))
    return transfers


def rounds(transfers: list[Transfer]) -> list[list[Transfer]]:
    """``transfers`` in rounds where no rank sends or receives twice (greedy, in list order)."""
    left, out = list(transfers), []
    while left:
        senders, receivers, this, rest = set(), set(), [], []
        for t in left:
            if t.sender in senders or t.receiver in receivers:
                rest.append(t)
            else:
                senders.add(t.sender)
                receivers.add(t.receiver)
                this.append(t)
        out.append(this)
        left = rest
    return out


def copy_files(directory: str, transfers: list[Transfer], group) -> int:
    """Carry out ``transfers`` (the same list on every rank of ``group``) between the ranks' ``directory``;
    returns the bytes this rank received."""
    rank = dist.get_rank(group)
    received = 0
    for batch in rounds(transfers):
        out = next((t for t in batch if t.sender == rank), None)
        into = next((t for t in batch if t.receiver == rank), None)
        if out is None and into is None:
            continue
        _move_pieces(directory, out, into, group)
        received += into.nbytes if into is not None else 0
    return received


def _pieces(nbytes: int) -> int:
    return max(1, -(-nbytes // PIECE))


def _move_pieces(directory: str, out: Transfer | None, into: Transfer | None, group) -> None:
    """Send ``out`` and receive ``into`` at the same time, piece by piece; what is received is written aside and
    renamed into place once complete."""
    path = os.path.join(directory, into.name) if into is not None else None
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with contextlib.ExitStack() as files:
            src = files.enter_context(open(os.path.join(directory, out.name), "rb", buffering=0)) if out else None
            if into is not None:
                os.makedirs(directory, exist_ok=True)
            dst = files.enter_context(open(tmp, "wb")) if into else None
            _move(src, dst, out, into, group)
        if into is not None:
            os.replace(tmp, path)
    finally:
        if into is not None and os.path.exists(tmp):
            os.remove(tmp)


def _move(src, dst, out: Transfer | None, into: Transfer | None, group) -> None:
    """Piece k of ``out`` (read from ``src``) and of ``into`` (written to ``dst``) travel together."""
    n_out = _pieces(out.nbytes) if out is not None else 0
    n_in = _pieces(into.nbytes) if into is not None else 0
    for k in range(max(n_out, n_in)):
        ops = []
        if k < n_out:
            size = min(PIECE, out.nbytes - k * PIECE)
            piece = torch.empty(size, dtype=torch.uint8)
            if src.readinto(memoryview(piece.numpy())) != size:
                raise CheckpointError(f"{src.name} changed size while it was copied")
            ops.append(dist.isend(piece, dist.get_global_rank(group, out.receiver), group=group))
        if k < n_in:
            incoming = torch.empty(min(PIECE, into.nbytes - k * PIECE), dtype=torch.uint8)
            ops.append(dist.irecv(incoming, dist.get_global_rank(group, into.sender), group=group))
        for op in ops:
            op.wait()
        if k < n_in:
            dst.write(memoryview(incoming.numpy()))


def fetch_missing(directory: str, names: list[str], host_keys: list[str], group) -> int:
    """Collective: every rank ends up able to read its ``names`` in its ``directory``, missing ones received
    from ranks (of other hosts) that hold them; returns the bytes this rank received."""
    everyone = all_gather((sorted(names), listing(directory)), group)
    transfers = plan_fetch([n for n, _ in everyone], [h for _, h in everyone], host_keys)
    if not transfers:  # the same plan on every rank: all skip
        return 0
    received = copy_files(directory, transfers, group)
    dist.barrier(group=group)  # a file received by one rank of a host is there for the others
    return received
