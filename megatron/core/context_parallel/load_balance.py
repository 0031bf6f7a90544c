"""The load-balanced sequence layout of context parallelism (Megatron-core's causal load balancing).

The full sequence is cut into 2 x CP equal chunks and CP rank r holds chunks r and 2 x CP - 1 - r, in that
order: under a causal mask the early chunks attend to little and the late ones to much, so pairing chunk r
with its mirror gives every rank the same amount of attention work.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk ids (of 2 x ``cp_size``) that CP rank ``cp_rank`` holds, in its local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is outside 0..{cp_size - 1}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _check_divisible(length: int, cp_size: int) -> None:
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not divisible by 2 x --context-parallel-size {cp_size} = "
                         f"{2 * cp_size}: context parallelism cuts every sequence into that many equal chunks")


def split_for_context_parallel(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's local sequence of ``t``: its two chunks along ``dim``, concatenated (``t`` itself for CP 1)."""
    if cp_size == 1:
        return t
    _check_divisible(t.shape[dim], cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def _position_of_chunk(chunk: int, cp_size: int) -> int:
    """Where chunk ``chunk`` sits in the concatenation of all ranks' local sequences (rank order)."""
    return 2 * chunk if chunk < cp_size else 2 * (2 * cp_size - 1 - chunk) + 1


def to_natural_order(t: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """The concatenation of all ranks' local sequences along ``dim`` (rank 0 first) -> the full sequence in
    natural order. Differentiable (chunk and cat), so the all-to-all path can use it under autograd."""
    if cp_size == 1:
        return t
    _check_divisible(t.shape[dim], cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[_position_of_chunk(c, cp_size)] for c in range(2 * cp_size)], dim=dim)


def to_load_balanced_order(t: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """The inverse of ``to_natural_order``: the full sequence -> all ranks' local sequences, concatenated."""
    if cp_size == 1:
        return t
    _check_divisible(t.shape[dim], cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[c] for r in range(cp_size) for c in chunk_ids(cp_size, r)], dim=dim)


def gather_from_context_parallel(local_parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Every rank's local sequence (index = CP rank) -> the full sequence in natural order along ``dim``."""
    return to_natural_order(torch.cat(list(local_parts), dim=dim), dim, len(local_parts))
