"""The data-parallel group laid over hosts: the subgroups hierarchical ZeRO-3 gathers and reduces over.

Ranks of a data-parallel group are listed in global-rank order; torchrun gives each host a contiguous block of
global ranks, so with tensor, context and expert groups placed inside a host (Megatron's order) the members of
one data-parallel group on one host are consecutive in that list. Every layout below is built from blocks of
consecutive members:

- ``shard``: the group a chunk is split over. The whole data-parallel group (flat ZeRO-3), or blocks of
  ``mics_shard_size`` members (MiCS / HSDP), then ``replicate`` holds the members with the same place in every
  block (the gradient shards are all-reduced across it).
- ``node``: the members on this host (``zero_hpz_partition_size`` consecutive members when that is set, else
  the members torchrun started on this host, from ``LOCAL_WORLD_SIZE``); ``cross``: the members with the same
  place on every host. hpZ's secondary gathers run over ``node``; qgZ reduce-scatters over ``node`` in full
  precision, then exchanges int8 pieces over ``cross``; on gloo a job that spans hosts gets them too, for its
  two-hop gathers and reduce-scatters.

Process groups are created collectively: every rank of the world gathers every rank's data-parallel group once
and creates the subgroups of all of them in one order (``torch.distributed.new_group`` must be called by every
rank for every group). Groups are cached per rank list for the life of the default group, so building a second
engine creates nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from .config import ZeroConfigError, ZeroOptimizationConfig


@dataclass(frozen=True)
class Topology:
    """This rank's data-parallel subgroups (process groups; None: not used by the layout)."""
    shard: object  # None: the data-parallel group itself
    replicate: object | None = None
    node: object | None = None
    cross: object | None = None


FLAT = Topology(shard=None)

_cache: dict[tuple[int, ...], object] = {}
_cache_world: list[object] = [None]


def _group(ranks: tuple[int, ...]):
    """The process group of ``ranks`` (created by every rank in the same order; cached)."""
    if _cache_world[0] is not dist.group.WORLD:  # a new default group: the old groups are gone
        _cache.clear()
        _cache_world[0] = dist.group.WORLD
    if ranks not in _cache:
        _cache[ranks] = dist.new_group(list(ranks))
    return _cache[ranks]


def _blocks(ranks: list[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(ranks[i:i + size]) for i in range(0, len(ranks), size)]


def _strided(ranks: list[int], size: int) -> list[tuple[int, ...]]:
    """The members with the same place in every block of ``size``."""
    return [tuple(ranks[j::size]) for j in range(size)]


def host_size(ranks: list[int], local_world_size: int) -> int:
    """Members of the data-parallel group ``ranks`` per host, when every host holds the same number in one
    consecutive block (torchrun's contiguous ranks per host); else an error naming the layout."""
    hosts = [r // local_world_size for r in ranks]
    counts = {h: hosts.count(h) for h in hosts}
    sizes = set(counts.values())
    contiguous = all(hosts[i] <= hosts[i + 1] for i in range(len(hosts) - 1))
    if len(sizes) != 1 or not contiguous:
        raise ZeroConfigError(
            f"zero_cache: the data-parallel group {ranks} is not spread evenly over hosts of {local_world_size} "
            f"ranks (LOCAL_WORLD_SIZE): members per host {counts}; set zero_hpz_partition_size to the members "
            f"per host, or use a layout whose data-parallel groups have the same number of ranks on every host")
    return sizes.pop()


def build_topology(z: ZeroOptimizationConfig, dp_group) -> Topology:
    """The subgroups ``z`` asks for, over the data-parallel group ``dp_group`` (None: the world), and on gloo the
    node and cross-node groups whenever the job spans hosts (for two-hop collectives, chunk_collectives.py).
    Collective over the world when any is built; nothing is created otherwise."""
    mics = z.mics_shard_size
    hpz = z.zero_hpz_partition_size
    if not (dist.is_available() and dist.is_initialized()):
        return FLAT
    ranks = sorted(dist.get_process_group_ranks(dp_group)) if dp_group is not None else \
        list(range(dist.get_world_size()))
    dp = len(ranks)
    if mics == dp:
        mics = -1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    asked = mics > 0 or hpz > 1 or z.zero_quantized_gradients
    # Decided alike on every rank: the same config, backend and world.
    two_hop = (mics <= 0 and z.gloo_p2p_collectives and local < dist.get_world_size()
               and dist.get_backend(dp_group) == dist.Backend.GLOO)
    if not asked and not two_hop:
        return FLAT
    for name, size in (("mics_shard_size", mics), ("zero_hpz_partition_size", hpz)):
        if size > 0 and dp % size:
            raise ZeroConfigError(f"zero_cache config: 'zero_optimization.{name}' {size} does not divide the "
                                  f"data-parallel size {dp}; choose a divisor (the ranks of one node)")
    # Every rank learns every data-parallel group, then all create the same groups in the same order.
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    groups = sorted({tuple(g) for g in everyone})
    if mics > 0:
        shard = replicate = None
        for g in groups:
            for block in _blocks(list(g), mics):
                pg = _group(block)
                if dist.get_rank() in block:
                    shard = pg
            for across in _strided(list(g), mics):
                pg = _group(across)
                if dist.get_rank() in across:
                    replicate = pg
        return Topology(shard=shard, replicate=replicate)
    try:
        sizes = {g: hpz if hpz > 1 else host_size(list(g), local) for g in groups}
    except ZeroConfigError:
        if asked:
            raise
        return FLAT  # an uneven layout: plain exchanges, as on one host
    node = cross = None
    for g in groups:
        for block in _blocks(list(g), sizes[g]):
            pg = _group(block)
            if dist.get_rank() in block:
                node = pg
        for across in _strided(list(g), sizes[g]):
            pg = _group(across)
            if dist.get_rank() in across:
                cross = pg
    return Topology(shard=None, node=node, cross=cross)
