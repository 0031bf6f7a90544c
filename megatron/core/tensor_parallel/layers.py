"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Weights are initialised on the full (unpartitioned) shape with the caller's
init function and then sliced, so a model has the same weights under every
tensor-parallel size; this is what makes TP runs comparable to a single-process
reference. With ``sequence_parallel`` the layers' inputs (column-parallel) and
outputs (row-parallel, the embedding) hold 1/TP of the sequence: they are
all-gathered in and reduce-scattered out instead of copied and all-reduced.
Partitioned parameters carry ``tensor_model_parallel = True`` and
``partition_dim`` so checkpoint tools can re-assemble them. With
``gradient_accumulation_fusion`` the linear and embedding layers add their
weight gradient into the gradient buffer themselves (zero_cache/weight_grad.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.deferred_init import defer_constant, init_or_defer
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from zero_cache.weight_grad import embedding, linear

InitMethod = Callable[[torch.Tensor], None]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor-parallel size ({denominator}); "
                         f"choose sizes so that it divides")
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, partition_dim: int) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim


def param_is_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for a replicated parameter on tp_rank > 0 (count it once in norms)."""
    return not getattr(param, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_rank() > 0


def initialize_partitioned_weight(weight: torch.Tensor, full_shape: tuple[int, ...], partition_dim: int,
                                  init_method: InitMethod | None) -> None:
    """Initialise the full weight with ``init_method`` and keep this rank's slice along ``partition_dim``
    (on the meta device: record that recipe for the ZeRO engine, see deferred_init.py)."""
    if init_method is None:
        return
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()

    def make() -> torch.Tensor:
        full = torch.empty(full_shape, dtype=torch.float32, device="cpu")
        init_method(full)
        return full.chunk(world, dim=partition_dim)[rank]

    init_or_defer(weight, make)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across tensor-parallel ranks."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 init_method: InitMethod | None = None, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 gradient_accumulation_fusion: bool = True, sequence_parallel: bool = False):
        super().__init__()
        world = ps.get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.sequence_parallel = sequence_parallel and world > 1
        self.output_size_per_partition = divide(output_size, world, "output size of a column-parallel layer")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                               dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        initialize_partitioned_weight(self.weight, (output_size, input_size), 0, init_method)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0)
            defer_constant(self.bias, 0.0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        """``weight`` overrides the layer's own (used for an output layer tied to the embedding)."""
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:  # the gather's backward reduce-scatters, summing over TP as the copy would
            x = gather_from_sequence_parallel_region(x)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        bias = None if self.skip_bias_add else self.bias
        out = linear(x, weight, bias, fuse=self.gradient_accumulation_fusion)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out)
        return (out, self.bias) if self.skip_bias_add else out


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features); partial results are all-reduced."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = True,
                 init_method: InitMethod | None = None, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 gradient_accumulation_fusion: bool = True, sequence_parallel: bool = False):
        super().__init__()
        world = ps.get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.sequence_parallel = sequence_parallel and world > 1
        self.input_size_per_partition = divide(input_size, world, "input size of a row-parallel layer")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        initialize_partitioned_weight(self.weight, (output_size, input_size), 1, init_method)
        if bias:
            # Replicated: added once after the all-reduce.
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, False, 0)
            defer_constant(self.bias, 0.0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        partial = linear(x, self.weight, fuse=self.gradient_accumulation_fusion)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial)
        else:
            out = reduce_from_tensor_model_parallel_region(partial)
        bias = self.bias
        if bias is not None and self.sequence_parallel:  # added to 1/TP of the tokens: sum its gradient over TP
            bias = copy_to_tensor_model_parallel_region(bias)
        if self.skip_bias_add:
            return out, bias
        return out + bias if bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up the ids it owns."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: InitMethod | None = None,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 gradient_accumulation_fusion: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        world = ps.get_tensor_model_parallel_world_size()
        self.sequence_parallel = sequence_parallel and world > 1
        self.num_embeddings = num_embeddings
        self.per_partition = divide(num_embeddings, world, "padded vocabulary size")
        self.vocab_start = ps.get_tensor_model_parallel_rank() * self.per_partition
        self.weight = nn.Parameter(torch.empty(self.per_partition, embedding_dim, dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        initialize_partitioned_weight(self.weight, (num_embeddings, embedding_dim), 0, init_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ps.get_tensor_model_parallel_world_size() == 1:
            return embedding(ids, self.weight, fuse=self.gradient_accumulation_fusion)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_partition)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = embedding(local, self.weight, fuse=self.gradient_accumulation_fusion)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out)
        return reduce_from_tensor_model_parallel_region(out)
