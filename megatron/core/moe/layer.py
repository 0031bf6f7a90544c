"""A mixture-of-experts MLP: route, dispatch to the experts (all-to-all with EP), compute, combine, plus shared
experts. In place of the dense MLP of the layers ``MoEConfig.is_moe_layer`` picks.

    x ─ router ─▶ (expert ids, probabilities) ─ dispatch ─▶ local experts ─ combine ─▶ + shared expert(x) ─▶ out
"""
from __future__ import annotations

import torch
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.moe.aux_loss import AuxLossScale, MoEStats, attach
from megatron.core.moe.experts import GroupedExperts
from megatron.core.moe.router import TopKRouter, first_forward
from megatron.core.moe.token_dispatcher import AllToAllDispatcher
from megatron.core.tensor_parallel import divide


class MoELayer(nn.Module):
    def __init__(self, config, prefix: str, layer_number: int, *, shared_expert: nn.Module | None,
                 aux_loss_scale: AuxLossScale, stats: MoEStats | None):
        """``config``: the model's TransformerConfig; ``shared_expert``: the dense MLP every token also goes
        through, gated or not (None: none); ``stats``: where the layer records its losses and load."""
        super().__init__()
        moe = config.moe
        self.moe, self.layer_number = moe, layer_number
        self.aux_loss_scale, self.stats = aux_loss_scale, stats
        ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.dispatcher = AllToAllDispatcher(moe.num_experts, ep, ep_rank, ps.get_expert_model_parallel_group())
        ffn = moe.expert_ffn_hidden_size(config.ffn_hidden_size)
        divide(ffn, tp, "--moe-ffn-hidden-size")
        self.router = TopKRouter(moe, config.hidden_size, config.init_method(prefix + "router.weight"),
                                 config.params_dtype)
        self.experts = GroupedExperts(
            hidden_size=config.hidden_size, ffn_hidden_size=ffn, num_experts=moe.num_experts,
            first_expert=self.dispatcher.first_local, num_local=self.dispatcher.num_local, swiglu=config.swiglu,
            gelu_approximate="tanh" if config.openai_gelu else "none", init_method=config.init_method,
            output_init_method=config.output_init_method, tp_size=tp, tp_rank=tp_rank, dtype=config.params_dtype,
            fusion=config.gradient_accumulation_fusion, grouped_gemm=moe.grouped_gemm, prefix=prefix + "experts.")
        if shared_expert is not None:
            self.shared_experts = shared_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        routing = self.router(tokens, b)
        rows, counts, state = self.dispatcher.dispatch(tokens, routing)
        out = self.dispatcher.combine(self.experts(rows, counts), state, b * s).to(x.dtype)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(tokens)
        if self.stats is not None and first_forward(self.training):
            self.stats.record(self.layer_number, routing.losses, routing.tokens_per_expert)
        return attach(out.view(b, s, h), routing.losses, self.aux_loss_scale)
