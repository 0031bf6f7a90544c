"""Point-to-point transfers of activations and gradients between adjacent pipeline stages.

Every call posts all its sends and receives together (``batch_isend_irecv``)
and waits for them, so paired calls on neighbouring stages (send_forward +
recv_forward, send_forward_recv_backward + send_backward_recv_forward) cannot
deadlock. Shapes are static: every micro-batch activation is
[micro_batch_size, seq_length, hidden_size].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _exchange(spec: TensorSpec, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
              recv_prev: bool = False, recv_next: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    ops, from_prev, from_next = [], None, None
    group = ps.get_pipeline_model_parallel_group()
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), ps.get_pipeline_model_parallel_prev_rank(), group))
    if recv_prev:
        from_prev = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device, requires_grad=True)
        ops.append(dist.P2POp(dist.irecv, from_prev, ps.get_pipeline_model_parallel_prev_rank(), group))
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next.contiguous(), ps.get_pipeline_model_parallel_next_rank(), group))
    if recv_next:
        from_next = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append(dist.P2POp(dist.irecv, from_next, ps.get_pipeline_model_parallel_next_rank(), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return from_prev, from_next


def recv_forward(spec: TensorSpec) -> torch.Tensor | None:
    if ps.is_pipeline_first_stage():
        return None
    return _exchange(spec, recv_prev=True)[0]


def recv_backward(spec: TensorSpec) -> torch.Tensor | None:
    if ps.is_pipeline_last_stage():
        return None
    return _exchange(spec, recv_next=True)[1]


def send_forward(output: torch.Tensor, spec: TensorSpec) -> None:
    if not ps.is_pipeline_last_stage():
        _exchange(spec, send_next=output.detach())


def send_backward(input_grad: torch.Tensor | None, spec: TensorSpec) -> None:
    if not ps.is_pipeline_first_stage():
        _exchange(spec, send_prev=input_grad)


def send_forward_recv_backward(output: torch.Tensor, spec: TensorSpec) -> torch.Tensor | None:
    if ps.is_pipeline_last_stage():
        return None
    return _exchange(spec, send_next=output.detach(), recv_next=True)[1]


def send_backward_recv_forward(input_grad: torch.Tensor | None, spec: TensorSpec) -> torch.Tensor | None:
    if ps.is_pipeline_first_stage():
        return None
    return _exchange(spec, send_prev=input_grad, recv_prev=True)[0]
