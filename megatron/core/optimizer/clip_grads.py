"""Global gradient L2 norm across model-parallel ranks, and clipping by it."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zero_cache.grad_norm import sum_of_squares


def get_grad_norm_fp32(grads: list[torch.Tensor], model_parallel_group: dist.ProcessGroup | None,
                       device: torch.device | str = "cpu") -> float:
    """L2 norm of ``grads`` over every rank of ``model_parallel_group`` (None: this process only).

    ``grads`` must already exclude tensor-parallel duplicates and shared copies so
    that every gradient element of the model is counted exactly once. Every rank
    of the group must call this, even with an empty list (``device`` then says
    where the partial sum lives for the all-reduce).
    """
    return grad_sum_of_squares(grads, model_parallel_group, device) ** 0.5


def grad_sum_of_squares(grads: list[torch.Tensor], group: dist.ProcessGroup | None,
                        device: torch.device | str = "cpu") -> float:
    """The squared L2 norm of ``grads`` summed over ``group`` (see ``get_grad_norm_fp32``)."""
    if grads:
        total_sq = torch.stack([sum_of_squares(g) for g in grads]).sum().reshape(1)
    else:
        total_sq = torch.zeros(1, dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=group)
    return float(total_sq)


def clip_grad_by_total_norm_fp32(params_or_grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale gradients in place by ``max_norm / total_norm`` when that is below 1.

    Accepts parameters (their ``.grad`` is clipped; those without one are
    skipped) or gradient tensors. Pass *all* gradients here, duplicates included:
    only the norm computation leaves duplicates out.
    """
    grads = [t.grad if isinstance(t, nn.Parameter) else t for t in params_or_grads]
    grads = [g for g in grads if g is not None]
    clip_coeff = max_norm / (total_norm + 1e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)
