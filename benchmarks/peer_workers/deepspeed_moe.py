"""DeepSpeed-MoE: our GPT (same embedding, attention, norms and head) whose MoE MLPs are DeepSpeed's native
``deepspeed.moe.layer.MoE``, trained by DeepSpeed's ZeRO stage 2, the highest it accepts for that layer.

Why stage 2: DeepSpeed 0.19.8 refuses stage 3 with its native MoE
(``runtime/engine.py`` ``_validate_zero3_moe_compatibility``: "Native DeepSpeed MoE is not supported with ZeRO
Stage 3. Use AutoEP or choose ZeRO stage 1/2."). Its offload at stage 2 is ``offload_optimizer`` only (stage 2
shards no parameters, so it has none to offload); ``device: nvme`` is accepted there but keeps the states in
host memory (``runtime/zero/stage_1_and_2.py``: ``cpu_offload`` for any device other than none), so the offload
rows use ``cpu``.

The experts match ours: bias-free SwiGLU (or GeLU) MLPs of the same width, one ``nn.Linear`` per projection per
expert (``linear_fc1``, ``linear_fc1_gate``, ``linear_fc2``), expert-parallel over ``spec.expert_parallel``
ranks in the same contiguous blocks as ours (rank r holds experts [r E/EP, (r + 1) E/EP)). The gate is set to
route as ours: ``drop_tokens=False`` (dropless: every expert takes all its tokens, capacity = the most loaded
expert's count over the expert-parallel group), ``use_rts=False``, ``noisy_gate_policy=None``,
``top2_2nd_expert_sampling=False`` (the second expert is the second-largest logit, no Gumbel noise); the two
weights are the softmax renormalised over the two choices, as ours. What still differs: its top-2 balancing
loss counts only each token's first choice (``sharded_moe.top2gating``: ``ce = mean(mask1)``, times E^2), ours
(Megatron-core's) counts both choices over 2T; the language-model losses of the first step are computed before
any update and agree, later steps differ by what that gradient difference moves (see moe_vs_peers.py).

Every weight is our initial weight: the GPT is built on the meta device from the spec (ours' init, seeded per
parameter name), each MoE layer is swapped for DeepSpeed's, whose router and local experts are filled from our
layer's initialisers (router ``[E, h]``, experts stacked ``[E_local, f, h]`` / ``[E_local, h, f]``), and every
other parameter from its own initialiser. The balancing losses DeepSpeed returns are added to the loss times
``spec.moe_aux_loss_coeff`` (as Megatron-DeepSpeed does); the reported loss is the language-model loss alone.
"""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.deferred_init import initial_value
from megatron.core.moe.layer import MoELayer

from .harness import COLLECTIVE_TIMEOUT, BenchSpec, build_model, model_config, param_groups


class ExpertMLP(nn.Module):
    """One expert as ours computes it (megatron/core/moe/experts.py): fc2(silu(gate(x)) * fc1(x)), no biases."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool, gelu_approximate: str):
        super().__init__()
        self.swiglu, self.gelu_approximate = swiglu, gelu_approximate
        self.linear_fc1 = nn.Linear(hidden, ffn, bias=False)
        if swiglu:
            self.linear_fc1_gate = nn.Linear(hidden, ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        h = F.silu(self.linear_fc1_gate(x)) * h if self.swiglu else F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)


class MoERecord:
    """What DeepSpeed's MoE layers returned in the current micro-batch's forward: balancing losses (for the loss)
    and choices per expert (for the padding its dropless capacity costs)."""

    def __init__(self):
        self.aux: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []

    def clear(self) -> None:
        self.aux.clear()
        self.counts.clear()


class DeepSpeedMoEMLP(nn.Module):
    """A transformer layer's MLP: DeepSpeed's MoE layer, its balancing loss handed to ``record``."""

    def __init__(self, moe: MoE, record: MoERecord):
        super().__init__()
        self.moe = moe
        self._record = record

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, exp_counts = self.moe(x)
        if self.training and torch.is_grad_enabled():
            self._record.aux.append(l_aux)
            self._record.counts.append(exp_counts.detach())
        return out


def _real(old: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``value`` that keeps the marks DeepSpeed put on ``old`` (expert: allreduce, group)."""
    new = nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)
    for attr in ("allreduce", "group_name"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    return new


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._parameters[leaf] = _real(target._parameters[leaf], value)


def deepspeed_moe_layer(ours: MoELayer, spec: BenchSpec, record: MoERecord) -> DeepSpeedMoEMLP:
    """DeepSpeed's MoE with ``ours``' initial router and local experts (``ours`` is on the meta device)."""
    cfg = model_config(spec)
    ffn = cfg.moe.expert_ffn_hidden_size(cfg.ffn_hidden_size)
    with torch.device("meta"):  # DeepSpeed deep-copies the expert per local expert: no memory until filled
        expert = ExpertMLP(cfg.hidden_size, ffn, cfg.swiglu, "tanh" if cfg.openai_gelu else "none")
        moe = MoE(hidden_size=cfg.hidden_size, expert=expert, num_experts=spec.num_experts,
                  ep_size=spec.expert_parallel, k=spec.moe_topk, capacity_factor=1.0, eval_capacity_factor=1.0,
                  min_capacity=0, use_residual=False, noisy_gate_policy=None, drop_tokens=False, use_rts=False,
                  use_tutel=False, enable_expert_tensor_parallelism=False, top2_2nd_expert_sampling=False)
    _set(moe, "deepspeed_moe.gate.wg.weight", initial_value("router.weight", ours.router.weight))
    stacks = {"linear_fc1": ours.experts.linear_fc1.weight, "linear_fc2": ours.experts.linear_fc2.weight}
    if cfg.swiglu:
        stacks["linear_fc1_gate"] = ours.experts.linear_fc1_gate.weight
    for proj, param in stacks.items():
        weights = initial_value(f"experts.{proj}.weight", param)  # [E_local, out, in], this rank's experts
        for j in range(weights.shape[0]):
            _set(moe, f"deepspeed_moe.experts.deepspeed_experts.{j}.{proj}.weight", weights[j].clone())
    return DeepSpeedMoEMLP(moe, record)


class DeepSpeedMoETrainer:
    @staticmethod
    def build_model(spec: BenchSpec, offload: bool) -> torch.nn.Module:
        if spec.zero_stage == 3:
            raise ValueError("DeepSpeed's native MoE (deepspeed.moe.layer.MoE) refuses ZeRO stage 3 in this "
                             "version; run it at stage 2")
        deepspeed.init_distributed(dist_backend="nccl" if spec.device == "cuda" else "gloo")
        # Our layer's experts are this rank's block (ps's expert-parallel rank = DeepSpeed's: both the rank in
        # one group of all ranks).
        ps.initialize_model_parallel(1, 1, timeout=COLLECTIVE_TIMEOUT, expert_model_parallel_size=spec.expert_parallel)
        with torch.device("meta"):
            model = build_model(spec)
        record = MoERecord()
        for layer in model.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                layer.mlp = deepspeed_moe_layer(layer.mlp, spec, record)
        for name, p in list(model.named_parameters()):
            if p.is_meta:
                _set(model, name, initial_value(name, p))
        for module in model.modules():
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    raise ValueError(f"buffer {name} of {type(module).__name__} has no initial value")
        model.moe_record = record
        return model

    def __init__(self, model: torch.nn.Module, spec: BenchSpec, gas: int, offload: bool):
        # DeepSpeed splits the expert parameters into groups of their own; it needs every group named.
        groups = [{**g, "name": n} for g, n in zip(param_groups(model, spec.weight_decay), ("decay", "no_decay"))]
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=[g for g in groups if g["params"]],
                                               config=spec.ds_config(dist.get_world_size(), offload))
        self.record: MoERecord = model.moe_record
        self.coeff = spec.moe_aux_loss_coeff
        self.steps: list[dict] = []
        self._aux, self._rows, self._routed = [], 0, 0

    def micro_batch(self, tokens, position_ids, labels, last: bool) -> torch.Tensor:
        if self.engine.is_gradient_accumulation_boundary() != last:
            raise RuntimeError(f"DeepSpeed's accumulation boundary (micro step {self.engine.micro_steps}) is not "
                               f"the harness's last micro-batch ({last}); check gradient_accumulation_steps")
        self.record.clear()
        loss = self.engine(tokens, position_ids, None, labels=labels).mean()
        total = loss
        if self.record.aux:
            aux = torch.stack([a.float() for a in self.record.aux])
            if self.coeff:
                self._aux.append(float(aux.detach().mean()) * self.coeff)
                total = loss + self.coeff * aux.sum()
            # Dropless capacity: every expert's buffer holds the most loaded expert's count (over the
            # expert-parallel group; this rank's count is a lower bound of it), so E x max rows are computed.
            for c in self.record.counts:
                self._rows += int(c.numel() * c.max())
                self._routed += int(c.sum())
        self.engine.backward(total)  # / gradient_accumulation_steps
        self.engine.step()
        if last:
            self.steps.append({"load_balancing_loss": sum(self._aux) / len(self._aux) if self._aux else None,
                               "expert_rows_over_routed": self._rows / self._routed if self._routed else None})
            self._aux, self._rows, self._routed = [], 0, 0
        return loss.detach()

    def step_stats(self) -> dict:
        return self.steps[-1] if self.steps else {}
