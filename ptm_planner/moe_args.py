"""The planner's mixture-of-experts flags: the trainer's own in (megatron/training/arguments/moe.py, read into
``TransformerConfig.moe`` by ``model_config_from_args``, and ``--expert-model-parallel-size``), and the planned
MoE out, as the flags the trainer takes (``--write-args``)."""
from __future__ import annotations

import argparse
import dataclasses

from megatron.core.moe.config import MoEConfig
from megatron.training.arguments.moe import add_moe_args  # noqa: F401  (the planner's parser takes the trainer's)

# MoEConfig field -> the trainer's flag; a bool field is a flag without a value.
FLAGS = {
    "num_experts": "--num-experts",
    "router_topk": "--moe-router-topk",
    "ffn_hidden_size": "--moe-ffn-hidden-size",
    "layer_freq": "--moe-layer-freq",
    "shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "shared_expert_gate": "--moe-shared-expert-gate",
    "score_function": "--moe-router-score-function",
    "pre_softmax": "--moe-router-pre-softmax",
    "topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "load_balancing_type": "--moe-router-load-balancing-type",
    "aux_loss_coeff": "--moe-aux-loss-coeff",
    "z_loss_coeff": "--moe-z-loss-coeff",
    "enable_expert_bias": "--moe-router-enable-expert-bias",
    "bias_update_rate": "--moe-router-bias-update-rate",
    "capacity_factor": "--moe-expert-capacity-factor",
    "token_drop_policy": "--moe-token-drop-policy",
}
ALWAYS = ("num_experts", "router_topk")  # written even at their defaults: they make the model an MoE


def add_expert_parallel_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--expert-model-parallel-size", "--moe-expert-parallel-size", dest="expert_model_parallel_size",
                       type=int, default=1, help="ranks that split each MoE layer's experts (divides the data-"
                                                 "parallel size; their states are sharded over DP / EP ranks)")


def _value(v: object) -> str:
    if isinstance(v, tuple):  # a --moe-layer-freq list, one shell word
        return "[" + ",".join(map(str, v)) + "]"
    return repr(v) if isinstance(v, float) else str(v)


def moe_megatron_args(moe: MoEConfig | None, expert_model_parallel_size: int) -> list[str]:
    """The flags that give the trainer ``moe`` (those not at their defaults, and the expert count and top-k) and
    the expert-parallel size; none for a dense model."""
    if moe is None:
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    out = []
    for name, flag in FLAGS.items():
        value = getattr(moe, name)
        if name not in ALWAYS and value == defaults[name]:
            continue
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, _value(value)]
    return out + ["--expert-model-parallel-size", str(expert_model_parallel_size)]
