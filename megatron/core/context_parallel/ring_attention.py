"""Ring attention ("p2p" context parallelism): causal attention over a sequence split across the CP ranks in
the load-balanced layout (load_balance.py), with key/value blocks passed around the ring.

Forward: in step t rank r holds the key/value block of rank (r - t) mod CP; the transfer of the next block is
posted before attention on the current one, so communication runs under compute. Which (query chunk, key
chunk) pairs attend follows from the chunk ids: a key chunk before the query chunk is attended in full, the
same chunk causally, a later one not at all. For the local layout (chunks r and 2CP-1-r) that gives three cases:

* step 0 (own block): causal over the whole local sequence (its two chunks are in increasing order);
* a block of a lower rank j: every local query against the block's first chunk (chunk j precedes both
  local chunks, chunk 2CP-1-j follows both);
* a block of a higher rank j: the second local chunk against the whole block (both of its chunks precede it).

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

from megatron.core.context_parallel.attention_kernels import attention_backward, attention_forward

# Gloo matches point-to-point messages by (peer, tag): key/value blocks and gradient accumulators can be in
# flight together between the same two ranks, so they get their own tags.
_KV_TAG = 0
_GRAD_TAG = 1

_Plan = list[tuple[slice, slice, bool]]


def _plan(cp_size: int, cp_rank: int, source: int, s_local: int) -> _Plan:
    """(local query rows, rows of the key/value block, causal) to attend for the block of rank ``source``."""
    half = s_local // 2
    if source == cp_rank:
        return [(slice(None), slice(None), True)]
    if source < cp_rank:
        return [(slice(None), slice(0, half), False)]
    return [(slice(half, None), slice(None), False)]


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


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_repeat_heads``: [b, hkv * groups, s, d] -> [b, hkv, s, d]."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(dim=2)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running ones for ``rows``, in place."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - new).unsqueeze(-1)
                       + block_out.to(out.dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    lse[:, :, rows] = new


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = lse = None
    kv = torch.stack([k, v])  # one message per step
    for step in range(ring.size):
        recv, works = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else (None, [])
        for rows, cols, causal in _plan(ring.size, ring.rank, (ring.rank - step) % ring.size, q.shape[2]):
            block_out, block_lse = attention_forward(q[:, :, rows], _repeat_heads(kv[0][:, :, cols], groups),
                                                     _repeat_heads(kv[1][:, :, cols], groups), causal, scale)
            if out is None:  # step 0 covers every row
                out, lse = block_out.to(acc), block_lse.to(acc)
            else:
                _merge(out, lse, rows, block_out, block_lse.to(acc))
        _wait(works)
        kv = recv
    return out.to(q.dtype), lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, ring: _Ring,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    grad_recv, grad_works = None, []
    for step in range(ring.size):
        kv_recv, kv_works = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else (None, [])
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for rows, cols, causal in _plan(ring.size, ring.rank, (ring.rank - step) % ring.size, q.shape[2]):
            dq_b, dk_b, dv_b = attention_backward(
                dout[:, :, rows], q[:, :, rows], _repeat_heads(kv[0][:, :, cols], groups),
                _repeat_heads(kv[1][:, :, cols], groups), out[:, :, rows], lse[:, :, rows], causal, scale)
            dq[:, :, rows] += dq_b
            dkv[0][:, :, cols] += _sum_heads(dk_b.to(acc), groups)
            dkv[1][:, :, cols] += _sum_heads(dv_b.to(acc), groups)
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


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"ring attention takes q [b, hq, s, d] and k, v [b, hkv, s, d]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, sequence or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads "
                         "(--num-attention-heads must be a multiple of --num-query-groups)")
    if q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} is odd: each context-parallel rank holds two equal "
                         "chunks of the sequence")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence: q [b, hq, s_local, d], k and v
    [b, hkv, s_local, d] (hq a multiple of hkv), all in the load-balanced layout -> [b, hq, s_local, d].
    ``scale`` defaults to 1/sqrt(d). Every rank of ``group`` must call it (and its backward) together."""
    if dropout_p > 0.0:
        raise ValueError(f"attention dropout {dropout_p} is not supported by ring attention (--cp-comm-type p2p): "
                         "set --attention-dropout 0, or use --cp-comm-type a2a")
    _check_inputs(q, k, v)
    return _RingAttention.apply(q, k, v, group, scale)
