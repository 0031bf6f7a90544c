"""Mixture-of-experts flags (Megatron-core's names, and Megatron-DeepSpeed's where they differ) -> ``MoEConfig``.

Expert parallelism (``--expert-model-parallel-size``) is read with the mesh (arguments/parallel.py).
"""
from __future__ import annotations

import argparse

from megatron.core.moe.config import (
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
    TOKEN_DROP_POLICIES,
    MoEConfig,
    parse_layer_freq,
)


def add_moe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("mixture of experts (docs/moe.md)")
    g.add_argument("--num-experts", type=int, nargs="+", default=None,
                   help="experts per MoE layer (Megatron-DeepSpeed's list form: one value; 1 = a dense model)")
    g.add_argument("--moe-router-topk", "--topk", dest="moe_router_topk", type=int, default=2,
                   help="experts each token goes to")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's MLP width (default: "
                   "--ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", default="1",
                   help="which layers are MoE: k (layers 0, k, 2k, ...) or a 0/1 list per layer, e.g. "
                        "\"([1]*3+[0]*1)*2\"")
    g.add_argument("--expert-interval", dest="moe_layer_freq", help="Megatron-DeepSpeed's spelling of "
                   "--moe-layer-freq k")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="width of the shared expert every token also goes through (default: none)")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by a learned sigmoid gate (Qwen-MoE)")
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="probabilities over all experts before the top-k (not renormalised over the k)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", "--moe-loss-coeff", dest="moe_aux_loss_coeff", type=float, default=0.0,
                   help="weight of the load-balancing loss (0: none)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router z-loss")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias on the choice, updated after every step")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-expert-capacity-factor", "--moe-train-capacity-factor", dest="moe_expert_capacity_factor",
                   type=float, default=None, help="tokens an expert takes, as a multiple of an even share; the rest "
                   "of its tokens skip it (default: dropless)")
    g.add_argument("--moe-token-drop-policy", choices=TOKEN_DROP_POLICIES, default="probs")
    g.add_argument("--disable-moe-token-dropping", action="store_true",
                   help="Megatron-DeepSpeed: dropless routing (the default here); conflicts with a capacity factor")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="accepted: the local experts always run as one grouped matmul where torch has one")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather", "alltoall_seq"],
                   default="alltoall", help="accepted: tokens always travel by all-to-all (same results)")
    g.add_argument("--moe-router-dtype", choices=["fp32"], default="fp32", help="the router always runs in fp32")
    return parser


def moe_config_from_args(args: argparse.Namespace) -> MoEConfig | None:
    experts = args.num_experts or [1]
    if len(set(experts)) > 1:
        raise ValueError(f"--num-experts {' '.join(map(str, experts))}: a different expert count per layer "
                         "(Megatron-DeepSpeed's pyramid MoE) is not implemented here; give one count")
    if experts[0] <= 1:  # a dense model; Megatron-DeepSpeed's dense scripts pass MoE settings, inert there too
        return None
    if args.disable_moe_token_dropping and args.moe_expert_capacity_factor is not None:
        raise ValueError("--disable-moe-token-dropping and a capacity factor (--moe-expert-capacity-factor / "
                         "--moe-train-capacity-factor) contradict each other; keep one")
    return MoEConfig(
        num_experts=experts[0], router_topk=args.moe_router_topk, ffn_hidden_size=args.moe_ffn_hidden_size,
        layer_freq=parse_layer_freq(str(args.moe_layer_freq)),
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        shared_expert_gate=args.moe_shared_expert_gate, score_function=args.moe_router_score_function,
        pre_softmax=args.moe_router_pre_softmax, topk_scaling_factor=args.moe_router_topk_scaling_factor,
        load_balancing_type=args.moe_router_load_balancing_type, aux_loss_coeff=args.moe_aux_loss_coeff,
        z_loss_coeff=args.moe_z_loss_coeff, enable_expert_bias=args.moe_router_enable_expert_bias,
        bias_update_rate=args.moe_router_bias_update_rate, capacity_factor=args.moe_expert_capacity_factor,
        token_drop_policy=args.moe_token_drop_policy)
