"""The GPT sizes users pick from: ``examples/start.sh SIZE`` and ``tools/plan_memory.py --size SIZE``.

One table, read by both (start.sh runs this module with any Python 3, before the project's environment
exists, so it uses the standard library only):

    python3 -m ptm_planner.sizes list          # the table, with each size's parameter count
    python3 -m ptm_planner.sizes row 1.3b      # "layers hidden heads ffn micro-batch" of one size
    python3 -m ptm_planner.sizes moe-args moe-8x1.3b   # the mixture-of-experts flags of a size (empty if dense)
    python3 -m ptm_planner.sizes seq-length    # the default sequence length of start.sh and the planner
    python3 -m ptm_planner.sizes seq-length 1.3b-32k   # a size's own sequence length (long-context sizes)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

# Sequence length used when none is given (start.sh's SEQ_LEN default and the planner's --seq-length).
DEFAULT_SEQ_LENGTH = 256
# The vocabulary the table's parameter counts are for: GPT-2's tokenizer, padded as the trainer pads it.
TABLE_VOCAB_SIZE, VOCAB_MULTIPLE = 50257, 128


def format_parameters(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@dataclass(frozen=True)
class ModelSize:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    micro_batch_size: int
    # Mixture of experts (every layer's MLP; None: a dense model): experts, experts per token, each expert's
    # ffn width and the shared expert's (None: none).
    num_experts: int | None = None
    router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    # Long-context sizes train at their own length, with rotary positions and no attention dropout (which ring
    # attention, the default context-parallel kind, does not take).
    seq_length: int = DEFAULT_SEQ_LENGTH

    @property
    def is_long_context(self) -> bool:
        return self.seq_length > DEFAULT_SEQ_LENGTH

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def num_parameters(self, *, active: bool = False) -> int:
        """Parameters of the model these flags build with the table's vocabulary (the trainer's GPT: biases,
        LayerNorm, GeLU MLP, tied embeddings, learned positions unless long-context); ``active``: only the top-k
        experts count."""
        h, f = self.hidden_size, self.ffn_hidden_size
        vocab = -(-TABLE_VOCAB_SIZE // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

        def mlp(width: int) -> int:  # two projections with biases
            return 2 * h * width + width + h

        if self.is_moe:  # every layer: bias-free experts, the router, and the shared expert if any
            experts = self.router_topk if active else self.num_experts
            ffn = experts * 2 * h * (self.moe_ffn_hidden_size or f) + self.num_experts * h
            ffn += mlp(self.shared_expert_intermediate_size) if self.shared_expert_intermediate_size else 0
        else:
            ffn = mlp(f)
        layer = 4 * h * h + 4 * h + ffn + 4 * h  # attention (QKV and output, with biases), two LayerNorms
        positions = 0 if self.is_long_context else self.seq_length * h
        return self.num_layers * layer + vocab * h + positions + 2 * h  # and the final LayerNorm

    def parameters_text(self) -> str:
        """The parameter count as the table gives it (mixtures of experts: total/active per token)."""
        total = format_parameters(self.num_parameters())
        return f"{total}/{format_parameters(self.num_parameters(active=True))}" if self.is_moe else total

    def moe_args(self) -> list[str]:
        """The Megatron-core mixture-of-experts flags of this size (none for a dense one)."""
        if not self.is_moe:
            return []
        out = ["--num-experts", str(self.num_experts), "--moe-router-topk", str(self.router_topk)]
        if self.moe_ffn_hidden_size is not None:
            out += ["--moe-ffn-hidden-size", str(self.moe_ffn_hidden_size)]
        if self.shared_expert_intermediate_size is not None:
            out += ["--moe-shared-expert-intermediate-size", str(self.shared_expert_intermediate_size)]
        return out + ["--moe-aux-loss-coeff", "1e-2"]  # load balancing, as Megatron-core's MoE recipes

    def megatron_args(self) -> list[str]:
        """The Megatron-LM model-shape flags of this size (with its mixture-of-experts flags)."""
        long = (["--seq-length", str(self.seq_length), "--position-embedding-type", "rope", "--attention-dropout", "0"]
                if self.is_long_context else [])
        return ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                "--num-attention-heads", str(self.num_attention_heads), "--ffn-hidden-size", str(self.ffn_hidden_size),
                *self.moe_args(), *long]


# GPT-3 paper shapes (125m .. 13b), the AngelPTM headline shapes (named 28 and 55 after the paper; their
# parameter counts are the table's) and mixtures of experts: moe-tiny (4 experts, trains on a CPU), moe-8x1.3b
# (1.3b with 8 copies of its MLP as experts, top-2) and moe-64e (64 fine-grained experts, top-6, and a shared
# expert, after DeepSeekMoE 16B); and 1.3b-32k, the 1.3b at 32K tokens per sequence (split it over ranks with CP=,
# see docs/parallelism.md).
SIZES: tuple[ModelSize, ...] = (
    ModelSize("default", 6, 256, 8, 1024, 4),
    ModelSize("125m", 12, 768, 12, 3072, 8),
    ModelSize("350m", 24, 1024, 16, 4096, 8),
    ModelSize("760m", 24, 1536, 16, 6144, 4),
    ModelSize("1.3b", 24, 2048, 16, 8192, 4),
    ModelSize("2.7b", 32, 2560, 32, 10240, 2),
    ModelSize("6.7b", 32, 4096, 32, 16384, 1),
    ModelSize("13b", 40, 5120, 40, 20480, 1),
    ModelSize("28", 26, 8192, 128, 32768, 38),
    ModelSize("55", 68, 8192, 64, 32768, 10),
    ModelSize("moe-tiny", 4, 256, 8, 1024, 4, num_experts=4, router_topk=2, moe_ffn_hidden_size=512),
    ModelSize("moe-8x1.3b", 24, 2048, 16, 8192, 4, num_experts=8, router_topk=2),
    ModelSize("moe-64e", 28, 2048, 16, 8192, 2, num_experts=64, router_topk=6, moe_ffn_hidden_size=1408,
              shared_expert_intermediate_size=2816),
    ModelSize("1.3b-32k", 24, 2048, 16, 8192, 1, seq_length=32768),
)


def get_size(name: str) -> ModelSize:
    for size in SIZES:
        if size.name == name:
            return size
    raise ValueError(f"unknown SIZE '{name}'; choose one of: {', '.join(s.name for s in SIZES)}")


def table() -> str:
    lines = [f"sizes (parameters with GPT-2's {TABLE_VOCAB_SIZE}-token vocabulary, total/active per token for a "
             "mixture of experts; layers hidden heads ffn micro-batch; mixtures of experts also: experts top-k "
             "expert-ffn shared-expert-ffn; long-context sizes: their sequence length):"]
    for s in SIZES:
        row = (f"  {s.name:<10} {s.parameters_text():<12} {s.num_layers:<4} {s.hidden_size:<5} "
               f"{s.num_attention_heads:<5} {s.ffn_hidden_size:<6} {s.micro_batch_size}")
        if s.is_moe:
            row += (f"{'':<4} {s.num_experts:<4} {s.router_topk:<3} {s.moe_ffn_hidden_size or s.ffn_hidden_size:<6} "
                    f"{s.shared_expert_intermediate_size or '-'}")
        if s.is_long_context:
            row += f"{'':<4} seq {s.seq_length}"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["list"]:
        print(table())
        return 0
    if argv == ["seq-length"]:
        print(DEFAULT_SEQ_LENGTH)
        return 0
    # One size's fields, each as start.sh reads them.
    fields = {
        "row": lambda s: f"{s.num_layers} {s.hidden_size} {s.num_attention_heads} {s.ffn_hidden_size} "
                         f"{s.micro_batch_size}",
        "moe-args": lambda s: " ".join(s.moe_args()),
        "seq-length": lambda s: str(s.seq_length),
    }
    if len(argv) == 2 and argv[0] in fields:
        try:
            size = get_size(argv[1])
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        print(fields[argv[0]](size))
        return 0
    print("usage: python3 -m ptm_planner.sizes list | row SIZE | moe-args SIZE | seq-length [SIZE]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
