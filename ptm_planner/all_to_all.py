"""The token exchange of MoE layers: what one rank sends over the expert-parallel group per step.

Per MoE layer and micro-batch the forward makes two all-to-alls (dispatch: each routed row to the rank holding
its expert; combine: the experts' outputs back) and the backward two (their gradients, the other way); a
full recompute runs the forward's two again. Each moves the rank's routed rows of h elements, of which
(EP - 1) / EP go to other ranks when the routing is even (megatron/core/moe/token_dispatcher.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer_config import TransformerConfig


@dataclass(frozen=True)
class AllToAll:
    ep: int
    rows: int  # routed rows (token copies) of one rank, MoE layer and micro-batch
    hidden_size: int
    element_size: int  # bytes (compute dtype)
    exchanges: int  # all-to-alls per MoE layer and micro-batch: 4, or 6 with full recompute
    moe_layers: int  # of the rank's pipeline stage
    micro_batches: int  # per step

    @property
    def exchange_bytes(self) -> int:
        """Bytes one rank sends to the other expert-parallel ranks in one all-to-all."""
        return self.rows * self.hidden_size * self.element_size * (self.ep - 1) // self.ep

    @property
    def step_bytes(self) -> int:
        """Bytes one rank sends in all its all-to-alls of one step."""
        return self.exchange_bytes * self.exchanges * self.moe_layers * self.micro_batches


def all_to_all(cfg: TransformerConfig, ep: int, micro_batch: int, moe_layers: int, micro_batches: int,
               recompute: bool) -> AllToAll:
    moe = cfg.moe
    rows = cfg.seq_length * micro_batch * moe.router_topk
    return AllToAll(ep, rows, cfg.hidden_size, cfg.params_dtype.itemsize, 6 if recompute else 4, moe_layers,
                    micro_batches)
