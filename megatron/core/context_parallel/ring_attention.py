"""Ring attention ("p2p" context parallelism): causal attention over a sequence split across the CP ranks in
the load-balanced layout (load_balance.py), with key/value blocks passed around the ring.

Forward: in step t rank r holds the key/value block of rank (r - t) mod CP; the transfer of the next block is
posted before attention on the current one, so communication runs under compute. Which rows attend to a block,
and how, is ``blocks.block_plan``.

Partial outputs are merged by their log-sum-exp in fp32. Backward sends the key/value blocks around the ring
once more, each with an accumulator of its dK/dV that every rank adds its share to; the accumulators make one
hop more than the blocks, which lands each at the rank that owns its key/value. dQ accumulates locally. The
accumulator of step t is sent while step t+1 computes. Every rank posts the same transfers in the same order.

Grouped-query attention: k and v travel with their own (fewer) heads and are repeated per block for the kernel;
the block's dK/dV are summed back over the repeated heads. Attention dropout is not supported.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.context_parallel.blocks import add_block_gradients, attend_block, block_plan, check_inputs

# Gloo matches point-to-point messages by (peer, tag): key/value blocks and gradient accumulators can be in
# flight together between the same two ranks, so they get their own tags.
_KV_TAG = 0
_GRAD_TAG = 1


class _Ring:
    """The CP group's ring: this rank, its size, and the global ranks of the next and previous rank."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post: send ``send`` to the next rank, receive the previous rank's into a new buffer; (buffer, works)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out = lse = None
    kv = torch.stack([k, v])  # one message per step
    for step in range(ring.size):
        recv, works = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else (None, [])
        plan = block_plan(ring.size, ring.rank, (ring.rank - step) % ring.size, q.shape[2])
        out, lse = attend_block(q, kv[0], kv[1], plan, scale, out, lse)  # step 0, the own block, covers every row
        _wait(works)
        kv = recv
    return out.to(q.dtype), lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, ring: _Ring,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    grad_recv, grad_works = None, []
    for step in range(ring.size):
        kv_recv, kv_works = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else (None, [])
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        plan = block_plan(ring.size, ring.rank, (ring.rank - step) % ring.size, q.shape[2])
        add_block_gradients(dout, q, kv[0], kv[1], out, lse, plan, scale, dq, dkv)
        if ring.size > 1:
            # The accumulator of this block so far comes from the previous rank (posted a step ago); add this
            # rank's share and pass it on. After the last step the received one is this rank's own, complete.
            _wait(grad_works)
            if grad_recv is not None:
                dkv += grad_recv
            grad_recv, grad_works = ring.shift(dkv, _GRAD_TAG)
        else:
            grad_recv = dkv
        _wait(kv_works)
        kv = kv_recv
    _wait(grad_works)
    return dq.to(q.dtype), grad_recv[0].to(k.dtype), grad_recv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Causal attention over the CP ranks' load-balanced sequences (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.ring, ctx.scale)
        return dq, dk, dv, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence: q [b, hq, s_local, d], k and v
    [b, hkv, s_local, d] (hq a multiple of hkv), all in the load-balanced layout -> [b, hq, s_local, d].
    ``scale`` defaults to 1/sqrt(d). Every rank of ``group`` must call it (and its backward) together."""
    if dropout_p > 0.0:
        raise ValueError(f"attention dropout {dropout_p} is not supported by ring attention (--cp-comm-type p2p): "
                         "set --attention-dropout 0, or use --cp-comm-type a2a")
    check_inputs(q, k, v, "ring attention")
    return _RingAttention.apply(q, k, v, group, scale)
