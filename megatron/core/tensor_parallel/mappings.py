"""Autograd functions that move activations in and out of the tensor-parallel region.

Each pair is conjugate: what the forward does (identity, all-reduce, split,
all-gather, reduce-scatter) the backward undoes with the adjoint operation, so
that gradients equal those of the unpartitioned model.

The sequence-parallel ones split or join the sequence dimension (dim 1 of the
[batch, seq, hidden] activations): outside the tensor-parallel regions each TP
rank holds 1/TP of the sequence; an all-gather enters a region, a
reduce-scatter leaves it (in place of the all-reduce).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from zero_cache.comm import all_gather_flat, reduce_scatter_flat

SEQ_DIM = 1


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if ps.get_tensor_model_parallel_world_size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    if x.shape[-1] % world != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[ps.get_tensor_model_parallel_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    """[b, s, ...] -> contiguous [s, b, ...], so that the flat collectives split the sequence (free when b = 1)."""
    return x.transpose(0, SEQ_DIM).contiguous()


def _split_seq(x: torch.Tensor) -> torch.Tensor:
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    if x.shape[SEQ_DIM] % world:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by tensor-parallel size {world} "
                         "(--sequence-parallel)")
    return x.chunk(world, dim=SEQ_DIM)[ps.get_tensor_model_parallel_rank()].contiguous()


def _gather_seq(x: torch.Tensor) -> torch.Tensor:
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    local = _seq_first(x)
    out = local.new_empty((local.shape[0] * world, *local.shape[1:]))
    all_gather_flat(out, local, group=ps.get_tensor_model_parallel_group())
    return out.transpose(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: torch.Tensor) -> torch.Tensor:
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    full = _seq_first(x)
    if full.shape[0] % world:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by tensor-parallel size {world} "
                         "(--sequence-parallel)")
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    reduce_scatter_flat(out, full, group=ps.get_tensor_model_parallel_group())
    return out.transpose(0, SEQ_DIM).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone())


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad)


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad)


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad)


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel layer)."""
    return _CopyToRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduce forward; identity backward (output of a row-parallel layer)."""
    return _ReduceFromRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; all-gather the gradient."""
    return _ScatterToRegion.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dimension; keep this rank's slice of the gradient."""
    return _GatherFromRegion.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's 1/TP of the sequence (of a tensor every TP rank holds whole); all-gather the gradient."""
    return _ScatterToSequence.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather the sequence (entering a tensor-parallel region); reduce-scatter the gradient, which each TP
    rank holds a partial sum of."""
    return _GatherFromSequence.apply(x)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Sum the partial results over TP and keep this rank's 1/TP of the sequence (leaving a tensor-parallel
    region); all-gather the gradient."""
    return _ReduceScatterToSequence.apply(x)
