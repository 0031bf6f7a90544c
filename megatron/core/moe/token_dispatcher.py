"""Moving tokens to their experts and back: permutation by expert, and all-to-all over the expert-parallel ranks.

dispatch: each (token, choice) pair that survived capacity becomes a row; rows are sorted by expert, sent to the
rank that holds the expert (experts are split into contiguous blocks, ``ep_rank`` holding
``[ep_rank * E_local, (ep_rank + 1) * E_local)``), and the rows received from every rank are regrouped by local
expert, so the experts see one contiguous run of rows each. combine undoes every step and sums each token's
rows weighted by the router's probabilities. The split sizes of the all-to-all are exchanged first (one small
all-to-all of the counts); every rank of the expert-parallel group issues the same two collectives per
direction, whatever its routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.moe.router import Routing


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to their ranks; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


class _Permute(torch.autograd.Function):
    """``x[order]`` for a permutation ``order`` (``inverse``: its inverse). The gradient is gathered back by the
    inverse, where ``index_select``'s own backward would zero a buffer of the rows and scatter-add into it."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.inverse = inverse
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.inverse), None, None


@dataclass
class DispatchState:
    """What combine needs to undo a dispatch."""
    token_of_row: torch.Tensor  # [N] token index of each kept (token, choice) pair, in (token, choice) order
    weight_of_row: torch.Tensor  # [N] its router probability
    sort_by_expert: torch.Tensor  # [N] rows in expert order
    send_splits: list[int]  # rows sent to each expert-parallel rank
    recv_splits: list[int]  # rows received from each
    sort_by_local_expert: torch.Tensor | None  # received rows regrouped by local expert
    unsort_local_expert: torch.Tensor | None  # its inverse


class AllToAllDispatcher:
    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, ep_group: dist.ProcessGroup | None):
        if num_experts % ep_size:
            raise ValueError(f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size "
                             f"{ep_size}; choose an expert count that the expert-parallel ranks split evenly")
        self.num_experts, self.ep_size, self.ep_group = num_experts, ep_size, ep_group
        self.num_local = num_experts // ep_size
        self.first_local = ep_rank * self.num_local

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], DispatchState]:
        """(rows for the local experts grouped by expert, rows per local expert, state for ``combine``)."""
        num_tokens, k = routing.indices.shape
        experts = routing.indices.reshape(-1)
        token_of_row = torch.arange(num_tokens, device=x.device).repeat_interleave(k)
        weight_of_row = routing.probs.reshape(-1)
        if routing.keep is not None:
            kept = routing.keep.reshape(-1)
            experts, token_of_row, weight_of_row = experts[kept], token_of_row[kept], weight_of_row[kept]
        sort_by_expert = torch.argsort(experts, stable=True)
        rows = x.index_select(0, token_of_row[sort_by_expert])
        counts = torch.bincount(experts, minlength=self.num_experts)
        if self.ep_size == 1:
            state = DispatchState(token_of_row, weight_of_row, sort_by_expert, [], [], None, None)
            return rows, counts.tolist(), state
        # counts_from[r, e]: rows rank r sends to local expert e of this rank
        counts_from = torch.empty_like(counts)
        dist.all_to_all_single(counts_from, counts, group=self.ep_group)
        counts_from = counts_from.view(self.ep_size, self.num_local)
        send_splits = counts.view(self.ep_size, self.num_local).sum(1).tolist()
        recv_splits = counts_from.sum(1).tolist()
        received = _AllToAll.apply(rows, recv_splits, send_splits, self.ep_group)
        local_expert = torch.arange(self.num_local, device=x.device).repeat(self.ep_size)
        sort_by_local = torch.argsort(local_expert.repeat_interleave(counts_from.reshape(-1)), stable=True)
        unsort_local = _inverse(sort_by_local)
        state = DispatchState(token_of_row, weight_of_row, sort_by_expert, send_splits, recv_splits, sort_by_local,
                              unsort_local)
        return _Permute.apply(received, sort_by_local, unsort_local), counts_from.sum(0).tolist(), state

    def combine(self, expert_out: torch.Tensor, state: DispatchState, num_tokens: int) -> torch.Tensor:
        """[num_tokens, h]: each token's expert outputs, weighted by their probabilities and summed (in fp32)."""
        rows = expert_out
        if state.sort_by_local_expert is not None:
            rows = _Permute.apply(rows, state.unsort_local_expert, state.sort_by_local_expert)
            rows = _AllToAll.apply(rows, state.send_splits, state.recv_splits, self.ep_group)
        rows = _Permute.apply(rows, _inverse(state.sort_by_expert), state.sort_by_expert)
        weighted = rows.float() * state.weight_of_row.unsqueeze(-1)
        out = weighted.new_zeros((num_tokens, rows.shape[-1]))
        return out.index_add(0, state.token_of_row, weighted)
