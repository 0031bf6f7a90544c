"""Attention of a CP rank's queries over the sequence's key/value blocks, one block at a time, as ring attention
and all-gather attention both compute it: which rows attend to which block (from the load-balanced chunk ids),
grouped heads repeated for the kernel and summed back, and partial outputs merged by their log-sum-exp.

Block j is the local key/value sequence of CP rank j (chunks j and 2 CP - 1 - j). A key chunk before the query
chunk is attended in full, the same chunk causally, a later one not at all; for the local layout (chunks r and
2 CP - 1 - r) that leaves three cases:

* the own block: causal over the whole local sequence (its two chunks are in increasing order);
* the block of a lower rank j: every local query against the block's first chunk (chunk j precedes both local
  chunks, chunk 2 CP - 1 - j follows both);
* the block of a higher rank j: the second local chunk against the whole block (both of its chunks precede it).
"""
from __future__ import annotations

import torch

from megatron.core.context_parallel.attention_kernels import attention_backward, attention_forward

Plan = list[tuple[slice, slice, bool]]


def block_plan(cp_size: int, cp_rank: int, source: int, s_local: int) -> Plan:
    """(local query rows, rows of the key/value block, causal) to attend for the block of rank ``source``."""
    half = s_local // 2
    if source == cp_rank:
        return [(slice(None), slice(None), True)]
    if source < cp_rank:
        return [(slice(None), slice(0, half), False)]
    return [(slice(half, None), slice(None), False)]


def repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def sum_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``repeat_heads``: [b, hkv * groups, s, d] -> [b, hkv, s, d]."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(dim=2)


def merge_block(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
                block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running ones for ``rows``, in place."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - new).unsqueeze(-1)
                       + block_out.to(out.dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    lse[:, :, rows] = new


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, scale: float | None,
                 out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend the local queries to one key/value block ([b, hkv, s_local, d]) as ``plan`` says and fold the result
    into the running (out, lse), fp32 (float64 for float64); pass (None, None) with the own block, which covers
    every row."""
    groups, acc = q.shape[1] // k.shape[1], torch.promote_types(q.dtype, torch.float32)
    for rows, cols, causal in plan:
        block_out, block_lse = attention_forward(q[:, :, rows], repeat_heads(k[:, :, cols], groups),
                                                 repeat_heads(v[:, :, cols], groups), causal, scale)
        if out is None:
            out, lse = block_out.to(acc), block_lse.to(acc)
        else:
            merge_block(out, lse, rows, block_out, block_lse.to(acc))
    return out, lse


def add_block_gradients(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, plan: Plan, scale: float | None, dq: torch.Tensor,
                        dkv: torch.Tensor) -> None:
    """Add one block's share of the gradients, given the merged ``out`` and ``lse`` (the flash-attention identity):
    to ``dq`` (the local queries) and ``dkv`` ([2, b, hkv, s_local, d], the block's keys and values), in place."""
    groups = q.shape[1] // k.shape[1]
    for rows, cols, causal in plan:
        dq_b, dk_b, dv_b = attention_backward(dout[:, :, rows], q[:, :, rows], repeat_heads(k[:, :, cols], groups),
                                              repeat_heads(v[:, :, cols], groups), out[:, :, rows], lse[:, :, rows],
                                              causal, scale)
        dq[:, :, rows] += dq_b
        dkv[0][:, :, cols] += sum_heads(dk_b.to(dkv.dtype), groups)
        dkv[1][:, :, cols] += sum_heads(dv_b.to(dkv.dtype), groups)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """q [b, hq, s, d] and k, v [b, hkv, s, d], hq a multiple of hkv, s even (two chunks a rank)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"{what} takes q [b, hq, s, d] and k, v [b, hkv, s, d]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, sequence or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads "
                         "(--num-attention-heads must be a multiple of --num-query-groups)")
    if q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} is odd: each context-parallel rank holds two equal "
                         "chunks of the sequence")
