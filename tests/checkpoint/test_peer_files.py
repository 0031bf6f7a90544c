"""Checkpoint files copied between the hosts' own directories (zero_cache/checkpoint/peer_files.py)."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.dist_utils import run_distributed
from zero_cache.checkpoint import CheckpointError, peer_files
from zero_cache.checkpoint.peer_files import Transfer, plan_fetch, replica_ranks, rounds


def test_replicas_are_on_another_host_for_any_layout():
    assert replica_ranks(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert replica_ranks(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]
    assert replica_ranks(["a", "a", "a", "a"]) == [None] * 4
    for keys in (["a", "b", "a", "b"], ["a", "a", "a", "b"], ["a", "b", "b", "b"]):
        for jump in (None, 1, 2, 4, 7):
            buddies = replica_ranks(keys, jump)
            assert all(keys[b] != keys[r] for r, b in enumerate(buddies)), (keys, jump, buddies)


def test_fetch_plan_takes_each_file_once_per_host_and_spreads_the_senders():
    keys = ["a", "a", "b", "b"]
    held = [{"x": 1, "y": 2}, {"x": 1, "y": 2}, {}, {}]
    needed = [["x"], ["x", "y"], ["x", "y"], ["y"]]
    plan = plan_fetch(needed, held, keys)
    assert plan == [Transfer("x", 0, 2, 1), Transfer("y", 1, 2, 2)]
    assert [len(r) for r in rounds(plan)] == [1, 1]  # rank 2 receives one file at a time
    with pytest.raises(CheckpointError, match="z is held by no rank"):
        plan_fetch([["z"], [], [], []], held, keys)


def _copy_and_fetch(rank: int, world: int, root: str) -> tuple[int, int]:
    peer_files.PIECE = 1000  # several pieces per file, a partial last one
    keys = ["a", "a", "b", "b"]
    directory = os.path.join(root, keys[rank])
    os.makedirs(directory, exist_ok=True)
    mine = f"__{rank}_0.distcp"
    with open(os.path.join(directory, mine), "wb") as f:
        f.write(bytes((rank * 31 + i) % 251 for i in range(2500 + 700 * rank)))
    group = dist.group.WORLD
    sizes = peer_files.all_gather({mine: os.path.getsize(os.path.join(directory, mine))}, group)
    buddies = replica_ranks(keys)
    copies = [Transfer(n, r, b, s) for r, b in enumerate(buddies) for n, s in sizes[r].items()]
    peer_files.copy_files(directory, copies, group)
    dist.barrier()
    # Host b loses its memory (its ranks restarted): it gets every file back from host a.
    if keys[rank] == "b" and rank == 2:
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
    dist.barrier()
    every = [f"__{r}_0.distcp" for r in range(world)]
    received = peer_files.fetch_missing(directory, every, keys, group)
    return received, sum(os.path.getsize(os.path.join(directory, n)) for n in every)


@pytest.mark.multiprocess
def test_files_copied_to_a_peer_host_come_back_when_the_host_lost_them(tmp_path):
    results = run_distributed(_copy_and_fetch, 4, str(tmp_path))
    total = sum(2500 + 700 * r for r in range(4))
    assert [r[1] for r in results] == [total] * 4
    assert [r[0] for r in results[:2]] == [0, 0] and results[2][0] + results[3][0] == total
    for host in ("a", "b"):
        d = tmp_path / host
        assert sorted(os.listdir(d)) == [f"__{r}_0.distcp" for r in range(4)]  # no temporary file left
        for r in range(4):
            assert (d / f"__{r}_0.distcp").read_bytes() == bytes((r * 31 + i) % 251 for i in range(2500 + 700 * r))
