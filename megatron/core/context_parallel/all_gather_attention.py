"""All-gather ("allgather") context parallelism, as Megatron-core's ``--cp-comm-type allgather``: every rank
gathers the whole sequence's keys and values and attends to them with its own queries.

One all-gather of k and v per layer, and one reduce-scatter of their gradients in the backward, in place of the
ring's CP - 1 point-to-point hops each way; no condition on the head counts. The blocks are attended and merged
as the ring does (``blocks.py``, the fused kernels of ``attention_kernels.py``), so no mask is built and, as with
the ring, there is no attention dropout. The price is memory: the backward keeps the whole sequence's keys and
values, CP times the ring's, so it suits grouped-query models (few key/value heads) and moderate CP sizes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.context_parallel.blocks import add_block_gradients, attend_block, block_plan, check_inputs
from zero_cache.comm import all_gather_flat, reduce_scatter_flat


def _sources(cp_size: int, cp_rank: int) -> list[int]:
    """The blocks in the order they are attended: the own one first (it covers every row), then the others."""
    return [cp_rank] + [j for j in range(cp_size) if j != cp_rank]


def _forward(q: torch.Tensor, kv: torch.Tensor, cp_rank: int, scale: float | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [CP, 2, b, hkv, s_local, d], every rank's block -> (out, lse) of the local queries."""
    out = lse = None
    for source in _sources(kv.shape[0], cp_rank):
        plan = block_plan(kv.shape[0], cp_rank, source, q.shape[2])
        out, lse = attend_block(q, kv[source, 0], kv[source, 1], plan, scale, out, lse)
    return out.to(q.dtype), lse


def _backward(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              cp_rank: int, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, the gradients of every block's keys and values), fp32."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    for source in _sources(kv.shape[0], cp_rank):
        plan = block_plan(kv.shape[0], cp_rank, source, q.shape[2])
        add_block_gradients(dout, q, kv[source, 0], kv[source, 1], out, lse, plan, scale, dq, dkv[source])
    return dq, dkv


class _AllGatherAttention(torch.autograd.Function):
    """Causal attention over the CP ranks' load-balanced sequences with gathered keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        own = torch.stack([k, v])
        kv = own.new_empty((cp * 2, *k.shape))  # rank j's k and v at rows 2j, 2j + 1
        all_gather_flat(kv, own, group=group)
        kv = kv.unflatten(0, (cp, 2))
        out, lse = _forward(q, kv, rank, scale)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.rank, ctx.scale = group, rank, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = _backward(dout, q, kv, out, lse, ctx.rank, ctx.scale)
        mine = dkv.new_empty(dkv.shape[1:])  # the sum over the ranks of their gradients of this rank's block
        reduce_scatter_flat(mine, dkv.flatten(0, 1), group=ctx.group)
        return dq.to(q.dtype), mine[0].to(kv.dtype), mine[1].to(kv.dtype), None, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                         scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence: q [b, hq, s_local, d], k and v
    [b, hkv, s_local, d] (hq a multiple of hkv), in the load-balanced layout -> [b, hq, s_local, d]. ``scale``
    defaults to 1/sqrt(d). Every rank of ``group`` must call it (and its backward) together."""
    if dropout_p > 0.0:
        raise ValueError(f"attention dropout {dropout_p} is not supported by all-gather attention (--cp-comm-type "
                         "allgather): set --attention-dropout 0, or use --cp-comm-type a2a")
    check_inputs(q, k, v, "all-gather attention")
    return _AllGatherAttention.apply(q, k, v, group, scale)
