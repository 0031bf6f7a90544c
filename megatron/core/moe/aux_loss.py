"""Auxiliary losses that reach the router through autograd, and the per-step MoE statistics for the log line.

A router's balancing losses are not added to the language-model loss (which lives on the last pipeline
stage); ``attach`` hangs each one on the layer's output instead, so the backward that reaches the layer gives
it the gradient ``scale`` (Megatron-core's MoEAuxLossAutoScaler). ``scale`` is what the schedule multiplies the
language-model loss by before its backward: the loss scale divided by the number of micro-batches, so an
auxiliary loss is averaged over the micro-batches of a step like the language-model loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class AuxLossScale:
    """The factor of the current step's loss backward; set by the schedule before each global batch."""

    def __init__(self):
        self.value = 1.0


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, loss, scale: float):
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.loss_shape, ctx.scale, device=grad.device, dtype=torch.float32), None


def attach(output: torch.Tensor, losses: dict[str, torch.Tensor], scale: AuxLossScale) -> torch.Tensor:
    for loss in losses.values():
        if loss.requires_grad:
            output = _Attach.apply(output, loss, scale.value)
    return output


class MoEStats:
    """Sums over a logging interval, per MoE layer: the auxiliary losses and the choices per expert."""

    KEYS = ("load_balancing_loss", "z_loss")

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self._sums: torch.Tensor | None = None  # on the device of the recorded tensors: recording never syncs

    def record(self, layer: int, losses: dict[str, torch.Tensor], tokens_per_expert: torch.Tensor) -> None:
        if self._sums is None:
            self._sums = torch.zeros(self.num_layers, len(self.KEYS) + 1 + self.num_experts, dtype=torch.float64,
                                     device=tokens_per_expert.device)
        row = self._sums[layer]
        for i, key in enumerate(self.KEYS):
            if key in losses:
                row[i] += losses[key].detach().double()
        row[len(self.KEYS)] += 1  # micro-batches
        row[len(self.KEYS) + 1:] += tokens_per_expert.detach()

    def reduce_and_reset(self, group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
        """Every rank of ``group`` (the world: each stage holds its own layers) calls this together. Returns the
        losses averaged over layers, micro-batches and ranks, and the load imbalance (max / mean choices per
        expert) of each MoE layer and of the most and least imbalanced one."""
        width = len(self.KEYS) + 1 + self.num_experts  # zeros on a stage without MoE layers, or before any record
        sums = torch.zeros(self.num_layers, width, dtype=torch.float64, device=device) if self._sums is None \
            else self._sums.to(device, copy=True)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        sums = sums.cpu()
        if self._sums is not None:
            self._sums.zero_()
        seen = sums[:, len(self.KEYS)] > 0
        if not seen.any():
            return {}
        per_layer = sums[seen]
        calls = per_layer[:, len(self.KEYS)]
        out = {}
        for i, key in enumerate(self.KEYS):
            if per_layer[:, i].any():
                out[key] = float((per_layer[:, i] / calls).mean())
        counts = per_layer[:, len(self.KEYS) + 1:]
        imbalance = counts.max(1).values / counts.mean(1).clamp_min(1e-12)
        out["max_load_imbalance"] = float(imbalance.max())
        out["min_load_imbalance"] = float(imbalance.min())
        for layer, value in zip(seen.nonzero().flatten().tolist(), imbalance.tolist()):
            out[f"load_imbalance/layer{layer}"] = value
        return out
