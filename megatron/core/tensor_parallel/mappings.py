"""Autograd functions that move activations in and out of the tensor-parallel region.

Each pair is conjugate: what the forward does (identity, all-reduce, split,
all-gather) the backward undoes with the adjoint operation, so that gradients
equal those of the unpartitioned model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps


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
