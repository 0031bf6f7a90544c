"""Context-parallel causal attention: the sequence of every sample is split over the CP ranks in the load-balanced
layout (load_balance.py), and attention is computed by passing key/value blocks around a ring ("p2p",
ring_attention.py), by all-to-alls between a sequence split and a head split ("a2a", all_to_all_attention.py), or
by gathering the whole sequence's keys and values on every rank ("allgather", all_gather_attention.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.context_parallel.all_gather_attention import all_gather_attention
from megatron.core.context_parallel.all_to_all_attention import all_to_all_attention
from megatron.core.context_parallel.load_balance import (
    chunk_ids,
    gather_from_context_parallel,
    split_for_context_parallel,
    to_load_balanced_order,
    to_natural_order,
)
from megatron.core.context_parallel.ring_attention import ring_attention
from megatron.core.transformer_config import CP_COMM_TYPES as COMM_TYPES


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm_type: str,
                               group: dist.ProcessGroup, scale: float | None = None,
                               dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over the whole sequence for this CP rank's load-balanced local sequence: q
    [b, hq, s_local, d], k and v [b, hkv, s_local, d] -> [b, hq, s_local, d]. ``comm_type`` "p2p" (ring
    attention; no dropout), "a2a" (Ulysses; hq divisible by the CP size) or "allgather" (every rank gathers the
    whole sequence's k and v; no dropout)."""
    if comm_type == "p2p":
        return ring_attention(q, k, v, group, scale=scale, dropout_p=dropout_p)
    if comm_type == "a2a":
        return all_to_all_attention(q, k, v, group, scale=scale, dropout_p=dropout_p)
    if comm_type == "allgather":
        return all_gather_attention(q, k, v, group, scale=scale, dropout_p=dropout_p)
    raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")


__all__ = [
    "COMM_TYPES",
    "all_gather_attention",
    "all_to_all_attention",
    "chunk_ids",
    "context_parallel_attention",
    "gather_from_context_parallel",
    "ring_attention",
    "split_for_context_parallel",
    "to_load_balanced_order",
    "to_natural_order",
]
