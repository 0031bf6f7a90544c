"""All-to-all ("a2a") context parallelism, DeepSpeed-Ulysses: trade the sequence split for a head split around
attention, so each rank runs ordinary causal attention over the whole sequence for 1/CP of the heads.

An all-to-all turns every rank's [b, h, s/CP, d] into [b, h/CP, s, d]; the gathered sequence is the ranks'
load-balanced local sequences concatenated, so it is put into natural order before attention and back after,
and a second all-to-all returns the output to [b, h, s/CP, d]. The all-to-alls are autograd-aware: the
backward of each is the other. Key/value heads travel un-repeated when the CP size divides them (grouped-query
attention moves less data that way) and are repeated to the query heads first otherwise.

Attention dropout runs inside torch's SDPA on each rank's own heads, so its random state must differ per CP
rank the way it does per tensor-parallel rank (the caller's RNG tracker).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel.blocks import check_inputs
from megatron.core.context_parallel.load_balance import to_load_balanced_order, to_natural_order


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, h, s_local, d] on each rank -> [b, h/CP, CP * s_local, d]: this rank's heads, every rank's sequence."""
    cp = dist.get_world_size(group)
    send = x.unflatten(1, (cp, -1)).movedim(1, 0).contiguous()  # [CP, b, h/CP, s_local, d]: piece i to rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's sequence of this rank's heads
    return recv.movedim(0, 2).flatten(2, 3)


def _heads_to_sequence(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``_sequence_to_heads``: [b, h/CP, CP * s_local, d] -> [b, h, s_local, d]."""
    cp = dist.get_world_size(group)
    send = y.unflatten(2, (cp, -1)).movedim(2, 0).contiguous()  # [CP, b, h/CP, s_local, d]: rank i's sequence
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: this rank's sequence of rank i's heads
    return recv.movedim(0, 1).flatten(1, 2)


class _AllToAll(torch.autograd.Function):
    """``_sequence_to_heads`` (``to_heads``) or ``_heads_to_sequence``; the backward of each is the other."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _sequence_to_heads(x, group) if to_heads else _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return back(grad.contiguous(), ctx.group), None, None


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    check_inputs(q, k, v, "all-to-all attention")
    hq = q.shape[1]
    if hq % cp:
        raise ValueError(f"all-to-all context parallelism (--cp-comm-type a2a) splits the attention heads over the "
                         f"context-parallel ranks: {hq} query heads per tensor-parallel rank (--num-attention-heads "
                         f"/ TP) are not divisible by --context-parallel-size {cp}; key/value heads "
                         "(--num-query-groups) are repeated to match when they do not divide. Choose sizes that "
                         "divide, or use --cp-comm-type p2p or allgather")


def _exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup, cp: int) -> list[torch.Tensor]:
    """Sequence -> heads for tensors of equal shape in one all-to-all (stacked along the batch), then put into
    natural sequence order."""
    b = tensors[0].shape[0]
    x = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return list(to_natural_order(_AllToAll.apply(x, group, True), 2, cp).split(b, dim=0))


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                         scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence: q [b, hq, s_local, d], k and v
    [b, hkv, s_local, d], in the load-balanced layout -> [b, hq, s_local, d]. Needs hq divisible by the CP size
    (and by hkv). ``scale`` defaults to 1/sqrt(d). Every rank of ``group`` must call it (and its backward)."""
    cp = dist.get_world_size(group)
    _check_heads(q, k, v, cp)
    if k.shape[1] % cp:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    groups = q.shape[1] // k.shape[1]
    if cp == 1:
        qh, kh, vh = q, k, v
    elif groups == 1:
        qh, kh, vh = _exchange([q, k, v], group, cp)
    else:
        (qh,), (kh, vh) = _exchange([q], group, cp), _exchange([k, v], group, cp)
    if groups > 1:  # this rank's query heads use its key/value heads in the same grouped order
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=dropout_p, is_causal=True, scale=scale)
    if cp == 1:
        return out
    return _AllToAll.apply(to_load_balanced_order(out, 2, cp), group, False)
