"""The top-k router: which experts each token goes to, with what weight, and the balancing losses.

The router runs in fp32 whatever the model's precision (its logits decide discrete choices). Load balancing:
the Switch-Transformer auxiliary loss over the micro-batch (``aux_loss``) or per sequence (``seq_aux_loss``,
DeepSeek's), the z-loss on the logits, and DeepSeek-V3's aux-loss-free expert bias, which shifts only the
choice of experts (not their weights) and is nudged after every step towards an even load
(``update_expert_bias``). With a capacity factor, an expert keeps at most ``MoEConfig.capacity`` of the
micro-batch's tokens (the most probable ones, or the first ones) and the rest of its tokens skip it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.deferred_init import init_whole
from megatron.core.moe.config import MoEConfig


def first_forward(training: bool) -> bool:
    """A training forward that is not a recompute inside backward (statistics count it once)."""
    return training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class Routing(NamedTuple):
    """One micro-batch's routing of T tokens to k experts each. A tuple, so that ZeRO-3 finds the tensors in the
    router's output and gathers its weight again for the backward."""
    indices: torch.Tensor  # [T, k] expert ids
    probs: torch.Tensor  # [T, k] fp32 weights of the experts' outputs (0 where a choice was dropped)
    keep: torch.Tensor | None  # [T, k] bool: choices within their expert's capacity (None: all, dropless)
    losses: dict[str, torch.Tensor]  # "load_balancing_loss" / "z_loss", already multiplied by their coefficients
    tokens_per_expert: torch.Tensor  # [E] choices per expert before capacity (for the load statistics)


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int) -> torch.Tensor:
    """E * sum_e (mean score of e) * (fraction of the k*T choices that went to e); 1 when the load is even."""
    num_tokens, num_experts = scores.shape
    fraction = tokens_per_expert.float() / (num_tokens * topk)
    return num_experts * (scores.mean(0) * fraction).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean squared log-sum-exp of the logits."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class TopKRouter(nn.Module):
    def __init__(self, moe: MoEConfig, hidden_size: int, init_method, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=params_dtype))
        init_whole(self.weight, init_method)
        if moe.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
            # Choices per expert since the last update, summed over micro-batches (not saved).
            self.register_buffer("local_tokens_per_expert", torch.zeros(moe.num_experts, dtype=torch.float32),
                                 persistent=False)

    def _apply(self, fn, recurse=True):
        """``model.to(bf16)`` casts the weight; the expert bias and the counts stay fp32."""
        super()._apply(fn, recurse)
        for name in ("expert_bias", "local_tokens_per_expert"):
            buf = getattr(self, name, None)
            if buf is not None and buf.dtype != torch.float32:
                setattr(self, name, buf.float())
        return self

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1) if self.moe.score_function == "softmax" else torch.sigmoid(logits)

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) before capacity."""
        moe, k = self.moe, self.moe.router_topk
        bias = self.expert_bias if moe.enable_expert_bias else None
        if moe.score_function == "softmax" and not moe.pre_softmax:
            if bias is None:
                top_logits, indices = logits.topk(k, dim=-1)
            else:
                indices = (logits + bias).topk(k, dim=-1).indices
                top_logits = logits.gather(1, indices)
            probs = torch.softmax(top_logits, dim=-1)  # = softmax over all experts, renormalised over the k
        else:
            scores = self._scores(logits)
            indices = (scores if bias is None else scores + bias).topk(k, dim=-1).indices
            probs = scores.gather(1, indices)
            if moe.score_function == "sigmoid" and k > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        if moe.topk_scaling_factor is not None:
            probs = probs * moe.topk_scaling_factor
        return probs, indices

    def _capacity_mask(self, probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
        capacity = self.moe.capacity(indices.shape[0])
        if capacity is None:
            return None
        num_tokens, k = indices.shape
        flat = indices.reshape(-1)
        if self.moe.token_drop_policy == "probs":  # each expert keeps its most probable choices
            priority = probs.detach().reshape(-1)
        else:  # "position": the earliest tokens
            priority = -torch.arange(num_tokens, device=flat.device).repeat_interleave(k).float()
        # Sort by (expert, priority descending); a choice's rank within its expert decides whether it stays.
        order = torch.argsort(priority, descending=True, stable=True)
        order = order[torch.argsort(flat[order], stable=True)]
        counts = torch.bincount(flat, minlength=self.moe.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.empty_like(flat)
        rank_in_expert[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return (rank_in_expert < capacity).view(num_tokens, k)

    def forward(self, x: torch.Tensor, batch_size: int) -> Routing:
        """``x``: [T, h] tokens of ``batch_size`` sequences (T = batch_size x sequence length)."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        probs, indices = self._top_k(logits)
        tokens_per_expert = torch.bincount(indices.reshape(-1), minlength=moe.num_experts)
        keep = self._capacity_mask(probs, indices)
        if keep is not None:
            probs = probs * keep
        losses = {}
        if moe.load_balancing_type != "none" and moe.aux_loss_coeff > 0:
            scores = self._scores(logits)
            if moe.score_function == "sigmoid":
                scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
            if moe.load_balancing_type == "aux_loss":
                loss = switch_load_balancing_loss(scores, tokens_per_expert, moe.router_topk)
            else:  # seq_aux_loss: the same per sequence, averaged
                per_seq = indices.view(batch_size, -1, moe.router_topk)
                loss = torch.stack([
                    switch_load_balancing_loss(s, torch.bincount(i.reshape(-1), minlength=moe.num_experts),
                                               moe.router_topk)
                    for s, i in zip(scores.view(batch_size, -1, moe.num_experts), per_seq)]).mean()
            losses["load_balancing_loss"] = moe.aux_loss_coeff * loss
        if moe.z_loss_coeff:
            losses["z_loss"] = moe.z_loss_coeff * z_loss(logits)
        if moe.enable_expert_bias and first_forward(self.training):
            self.local_tokens_per_expert += tokens_per_expert
        return Routing(indices, probs, keep, losses, tokens_per_expert)


@torch.no_grad()
def update_expert_bias(routers: list[TopKRouter], group: dist.ProcessGroup | None) -> None:
    """After an optimizer step: move each expert's bias by ``bias_update_rate`` towards an even load, from the
    choices counted since the last update on every rank of ``group`` (all data-parallel ranks)."""
    routers = [r for r in routers if r.moe.enable_expert_bias]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    for router, c in zip(routers, counts):
        router.expert_bias += router.moe.bias_update_rate * torch.sign(c.mean() - c)
        router.local_tokens_per_expert.zero_()
