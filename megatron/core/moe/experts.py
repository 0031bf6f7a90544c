"""The local experts of one MoE layer: bias-free MLPs whose weights are stacked per projection.

``linear_fc1.weight`` is [E_local, ffn / TP, hidden] (``linear_fc1_gate`` too with SwiGLU) and
``linear_fc2.weight`` [E_local, hidden, ffn / TP]: expert parallelism splits dim 0, tensor parallelism the
ffn dim, as Megatron-core's grouped experts. Each expert is initialised from its own (seed, name) with its
global index, so the weights are the same under every EP/TP layout. The rows of every local expert go through
one grouped matmul per projection (``torch._grouped_mm`` where this torch has it for the device and dtype, a
loop over the experts otherwise); with gradient-accumulation fusion each expert's weight gradient is multiplied
straight into its slice of the gradient buffer (zero_cache/weight_grad.py). Every local expert runs every
micro-batch, with zero rows when no token chose it: every rank then runs the same autograd graph, so ZeRO's
gathers and reductions of the expert weights keep one order over the expert-data-parallel group.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.deferred_init import init_or_defer
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from zero_cache.weight_grad import add_product, weight_grad_sink


@functools.lru_cache(maxsize=None)
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` computes x @ w per group here (it is a private API, present for some
    devices and dtypes only); probed once on a tiny case against the plain matmuls."""
    if not hasattr(torch, "_grouped_mm") or (device_type == "cuda" and dtype != torch.bfloat16):
        return False
    try:
        x = torch.randn(24, 16, device=device_type).to(dtype)
        w = torch.randn(2, 16, 16, device=device_type).to(dtype)
        offs = torch.tensor([8, 24], dtype=torch.int32, device=device_type)
        got = torch._grouped_mm(x, w, offs=offs)
        want = torch.cat([x[:8] @ w[0], x[8:] @ w[1]])
        return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
    except (RuntimeError, NotImplementedError):
        return False


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int], offs: torch.Tensor | None) -> torch.Tensor:
    """Row block g of ``x`` (``counts[g]`` rows) times ``w[g]``: [rows, n] for ``w`` [G, k, n] (``offs``: the
    blocks' ends for torch's grouped matmul; None: a loop over the blocks)."""
    if offs is not None:
        return torch._grouped_mm(x, w, offs=offs)
    return torch.cat([block @ w[g] for g, block in enumerate(x.split(counts))])


def grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, counts: list[int],
                        offs: torch.Tensor | None) -> torch.Tensor:
    """[G, n, k]: grad_g^T @ x_g for every group (the weight gradient of ``x @ w[g]^T``)."""
    if offs is not None:
        return torch._grouped_mm(grad.t(), x, offs=offs)
    return torch.stack([g.t() @ block for g, block in zip(grad.split(counts), x.split(counts))])


class _GroupedLinear(torch.autograd.Function):
    """y = x_g @ w[g]^T per group, with the weight gradient handed to ``sink`` when there is one."""

    @staticmethod
    def forward(ctx, x, weight, counts, offs, sink):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.offs, ctx.sink = counts, offs, sink
        return grouped_mm(x, weight.transpose(1, 2), counts, offs)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad, offs = grad.contiguous(), ctx.offs
        grad_x = grouped_mm(grad, weight, ctx.counts, offs) if ctx.needs_input_grad[0] else None
        if ctx.sink is None:
            return grad_x, grouped_weight_grad(x, grad, ctx.counts, offs).to(weight.dtype), None, None, None

        def write(out: torch.Tensor, overwrite: bool) -> None:
            """Each expert's product straight into its slice of the buffer (no weight-sized temporary)."""
            for e, (g, block) in enumerate(zip(grad.split(ctx.counts), x.split(ctx.counts))):
                add_product(out[e], g, block, overwrite=overwrite)
        ctx.sink(write)
        return grad_x, None, None, None, None


class ExpertWeights(nn.Module):
    """One projection of the local experts: ``weight`` [E_local, out / TP, in] or [E_local, out, in / TP]."""

    def __init__(self, init_method_of, *, num_experts: int, first_expert: int, num_local: int, out_features: int,
                 in_features: int, tp_size: int, tp_rank: int, tp_dim: int, dtype: torch.dtype):
        super().__init__()
        local = [out_features, in_features]
        local[tp_dim - 1] //= tp_size
        self.weight = nn.Parameter(torch.empty(num_local, *local, dtype=dtype))
        p = self.weight
        p.allreduce = False  # Megatron-core's mark of an expert parameter: reduced over expert-data-parallel ranks
        p.tensor_model_parallel, p.partition_dim, p.expert_partition_dim = True, tp_dim, 0
        p.num_experts = num_experts

        def make() -> torch.Tensor:
            out = []
            for e in range(first_expert, first_expert + num_local):
                full = torch.empty(out_features, in_features, dtype=torch.float32)
                init_method_of(e)(full)
                out.append(full.chunk(tp_size, dim=tp_dim - 1)[tp_rank])
            return torch.stack(out)

        init_or_defer(p, make)

    def forward(self, x: torch.Tensor, counts: list[int], offs: torch.Tensor | None, fuse: bool) -> torch.Tensor:
        sink = weight_grad_sink(self.weight) if fuse and torch.is_grad_enabled() else None
        return _GroupedLinear.apply(x, self.weight, counts, offs, sink)


class GroupedExperts(nn.Module):
    def __init__(self, *, hidden_size: int, ffn_hidden_size: int, num_experts: int, first_expert: int,
                 num_local: int, swiglu: bool, gelu_approximate: str, init_method, output_init_method,
                 tp_size: int, tp_rank: int, dtype: torch.dtype, fusion: bool, grouped_gemm: bool, prefix: str):
        super().__init__()
        self.swiglu, self.gelu_approximate, self.fusion = swiglu, gelu_approximate, fusion
        self.grouped_gemm, self.tp_size = grouped_gemm, tp_size

        def projection(name: str, out_f: int, in_f: int, tp_dim: int, init) -> ExpertWeights:
            return ExpertWeights(lambda e: init(f"{prefix}{e}.{name}.weight"), num_experts=num_experts,
                                 first_expert=first_expert, num_local=num_local, out_features=out_f,
                                 in_features=in_f, tp_size=tp_size, tp_rank=tp_rank, tp_dim=tp_dim, dtype=dtype)

        self.linear_fc1 = projection("linear_fc1", ffn_hidden_size, hidden_size, 1, init_method)
        if swiglu:
            self.linear_fc1_gate = projection("linear_fc1_gate", ffn_hidden_size, hidden_size, 1, init_method)
        self.linear_fc2 = projection("linear_fc2", hidden_size, ffn_hidden_size, 2, output_init_method)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: rows grouped by local expert (``counts`` each) -> the experts' outputs, summed over TP."""
        offs = None
        if self.grouped_gemm and _grouped_mm_works(x.device.type, x.dtype):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        tp = self.tp_size > 1  # without tensor parallelism the regions' mappings would only copy the rows
        if tp:
            x = copy_to_tensor_model_parallel_region(x)
        h = self.linear_fc1(x, counts, offs, self.fusion)
        if self.swiglu:
            h = F.silu(self.linear_fc1_gate(x, counts, offs, self.fusion)) * h
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        out = self.linear_fc2(h, counts, offs, self.fusion)
        return reduce_from_tensor_model_parallel_region(out) if tp else out
