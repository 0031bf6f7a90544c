"""The shape and routing of a mixture-of-experts MLP (Megatron-core's ``--moe-*`` / ``--num-experts`` flags).

A ``TransformerConfig`` with ``moe`` set replaces the MLP of the layers ``is_moe_layer`` picks by an
``MoELayer`` (megatron/core/moe/layer.py): a router that sends each token to ``router_topk`` of
``num_experts`` experts, the experts (SwiGLU or GeLU MLPs of ``ffn_hidden_size``, without biases, split over
the expert-model-parallel ranks), and optionally a shared expert every token goes through.
"""
from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # --num-experts
    router_topk: int = 2  # --moe-router-topk: experts per token
    ffn_hidden_size: int | None = None  # --moe-ffn-hidden-size; None: the dense --ffn-hidden-size
    # --moe-layer-freq: every k-th layer (0, k, 2k, ...) is MoE, or one 0/1 entry per layer
    layer_freq: int | tuple[int, ...] = 1
    shared_expert_intermediate_size: int | None = None  # --moe-shared-expert-intermediate-size; None: none
    shared_expert_gate: bool = False  # --moe-shared-expert-gate: scale the shared expert by sigmoid(x . g)
    score_function: str = "softmax"  # --moe-router-score-function
    # --moe-router-pre-softmax: probabilities over all experts, then top-k (not renormalised). Without it,
    # top-k of the scores, then normalised over the k (softmax over the chosen logits; sigmoid scores / sum).
    pre_softmax: bool = False
    topk_scaling_factor: float | None = None  # --moe-router-topk-scaling-factor: multiplies the k weights
    load_balancing_type: str = "aux_loss"  # --moe-router-load-balancing-type
    aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff (0: no auxiliary loss)
    z_loss_coeff: float | None = None  # --moe-z-loss-coeff
    enable_expert_bias: bool = False  # --moe-router-enable-expert-bias: aux-loss-free balancing (DeepSeek-V3)
    bias_update_rate: float = 1e-3  # --moe-router-bias-update-rate
    capacity_factor: float | None = None  # --moe-expert-capacity-factor; None: dropless
    token_drop_policy: str = "probs"  # --moe-token-drop-policy: which tokens an expert over capacity keeps
    grouped_gemm: bool = True  # --moe-grouped-gemm: one grouped matmul over the local experts (else a loop)

    def __post_init__(self):
        if self.num_experts < 2:
            raise ValueError(f"--num-experts {self.num_experts}: a mixture of experts needs at least 2 "
                             "(drop the flag for a dense model)")
        if not 1 <= self.router_topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk {self.router_topk} must be between 1 and --num-experts "
                             f"{self.num_experts}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"--moe-router-score-function {self.score_function!r}: use one of {SCORE_FUNCTIONS}")
        if self.load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"--moe-router-load-balancing-type {self.load_balancing_type!r}: use one of "
                             f"{LOAD_BALANCING_TYPES}")
        if self.token_drop_policy not in TOKEN_DROP_POLICIES:
            raise ValueError(f"--moe-token-drop-policy {self.token_drop_policy!r}: use one of {TOKEN_DROP_POLICIES}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor {self.capacity_factor} must be > 0 (omit it for "
                             "dropless routing)")
        if self.pre_softmax and self.score_function != "softmax":
            raise ValueError("--moe-router-pre-softmax applies to --moe-router-score-function softmax only")
        if self.aux_loss_coeff < 0 or (self.z_loss_coeff or 0) < 0:
            raise ValueError("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
        if isinstance(self.layer_freq, int) and self.layer_freq < 1:
            raise ValueError(f"--moe-layer-freq {self.layer_freq} must be >= 1")

    def is_moe_layer(self, layer: int, num_layers: int) -> bool:
        """Whether global layer ``layer`` (0-based) of ``num_layers`` has an MoE MLP."""
        if isinstance(self.layer_freq, int):
            return layer % self.layer_freq == 0
        if len(self.layer_freq) != num_layers:
            raise ValueError(f"--moe-layer-freq has {len(self.layer_freq)} entries for --num-layers {num_layers}; "
                             "give one 0/1 per layer")
        return bool(self.layer_freq[layer])

    def expert_ffn_hidden_size(self, dense_ffn_hidden_size: int) -> int:
        return self.ffn_hidden_size or dense_ffn_hidden_size

    def capacity(self, num_tokens: int) -> int | None:
        """Tokens an expert takes per micro-batch and rank with a capacity factor (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, int(-(-num_tokens * self.router_topk * self.capacity_factor // self.num_experts)))


def parse_layer_freq(text: str) -> int | tuple[int, ...]:
    """``--moe-layer-freq``: an int k, a list "[1,0,1,0]", or Megatron's "([1]*3+[0]*1)*2" pattern."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    if not set(text) <= set("0123456789[]()*+, "):
        raise ValueError(f"--moe-layer-freq {text!r}: give an int k or a list such as [1,0,1,0] or ([1]*3+[0])*2")
    try:
        pattern = eval(text, {"__builtins__": {}}, {})  # digits, brackets, * and + only (checked above)
    except SyntaxError:
        raise ValueError(f"--moe-layer-freq {text!r} is not a valid pattern; e.g. [1,0,1,0] or ([1]*3+[0])*2") from None
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"--moe-layer-freq {text!r} must give a list of 0/1 entries")
    return tuple(pattern)
