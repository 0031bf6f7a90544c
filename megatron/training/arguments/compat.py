"""Megatron-LM and Megatron-DeepSpeed flags that have no feature of their own here: accepted or refused.

Real launch scripts pass flags for things this trainer does not have (FP8, knowledge distillation, ...)
or does not need to be told (overlapped gradient reduction, fused kernels). So that such scripts run as they
are, each of those flags is either

- accepted: what it asks for is what happens here anyway, or it tunes only speed or logging plumbing that
  does not exist here (its help says which), or
- refused: it asks for something this trainer does not do; ``check_compat`` names the flag, why, and what
  to use instead, in one line.

docs/megatron-compat.md lists every flag of those scripts and what it does here.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Refused:
    flags: tuple[str, ...]  # spellings of one flag
    why: str  # what it asks for and why that does not happen here, and what to do instead


# Accepted flags: (flag, takes a value, help). Their values are read nowhere.
ACCEPTED = (
    ("--use-mcore-models", False, "the model is Megatron-core's GPT already; no effect"),
    ("--overlap-grad-reduce", False, "gradient reduction always overlaps the backward here; no effect"),
    ("--overlap-param-gather", False, "the zero_cache engine schedules its parameter gathers itself; no effect"),
    ("--no-async-tensor-model-parallel-allreduce", False, "a speed knob of Megatron's kernels; no effect"),
    ("--no-query-key-layer-scaling", False, "query-key layer scaling is never applied here; no effect"),
    ("--no-create-attention-mask-in-dataloader", False,
     "the data loader never builds attention masks (causal attention needs none); no effect"),
    ("--no-mmap-bin-files", False, "the .bin files are always memory-mapped (same data); no effect"),
    ("--log-throughput", False, "the log line always shows tokens/s and TFLOP/s; no effect"),
    ("--cross-entropy-loss-fusion", False, "a fused kernel of Megatron's; the loss is the same; no effect"),
    ("--grad-reduce-in-bf16", False, "gradients are always reduced in fp32 here (more exact); no effect"),
    ("--log-optimizer-states-to-tensorboard", False, "optimizer-state norms are not computed here; no effect"),
    ("--deepspeed-activation-checkpointing", False,
     "recompute is the trainer's own (--recompute-granularity full / --checkpoint-activations); no effect"),
    ("--tiktoken-pattern", True, "read only by TikTokenizer, which is not offered here; no effect"),
)

# Refused whenever given (conditional refusals are in check_compat).
REFUSED = (
    Refused(("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
             "--fp8-margin", "--fp8-recipe", "--fp8-interval"),
            "FP8 training (Transformer Engine) is not implemented here; train in --bf16 and drop the --fp8-* flags"),
    Refused(("--decoupled-lr", "--decoupled-min-lr"),
            "a separate learning rate for the embedding and output layers is not implemented here; drop it "
            "(every parameter follows --lr / --min-lr)"),
    Refused(("--mos", "--kd", "--kd-alpha-ce", "--kd-beta-ce", "--kd-temp", "--load-teacher", "--num-layers-teacher",
             "--hidden-size-teacher", "--num-attention-heads-teacher", "--num-experts-teacher"),
            "knowledge distillation (Megatron-DeepSpeed's --kd / --mos) is not implemented here; drop the teacher "
            "flags"),
    Refused(("--cpu-optimizer",),
            "the optimizer runs where the zero_cache engine keeps its states; use --deepspeed with "
            "\"offload_optimizer\": {\"device\": \"cpu\"} in the JSON instead"),
)

# Megatron-DeepSpeed's MoE settings without a counterpart here (the others are aliases, arguments/moe.py).
MOE_SETTINGS = ("--moe-eval-capacity-factor", "--moe-min-capacity", "--create-moe-param-group")


def _dest(flag: str) -> str:
    return "compat_" + flag.lstrip("-").replace("-", "_")


def add_compat_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("accepted for Megatron-LM / Megatron-DeepSpeed scripts (docs/megatron-compat.md)")
    for flag, takes_value, why in ACCEPTED:
        if takes_value:
            g.add_argument(flag, dest=_dest(flag), default=None, help=why)
        else:
            g.add_argument(flag, dest=_dest(flag), action="store_true", help=why)
    g.add_argument("--mlp-type", default="standard", help="Megatron-DeepSpeed: standard; residual (PR-MoE) is refused")
    for flag in MOE_SETTINGS:
        g.add_argument(flag, dest=_dest(flag), nargs="*", default=None,
                       help="Megatron-DeepSpeed MoE setting: accepted, no effect (evaluation uses the training "
                            "routing; experts always have their own parameter group)")
    for refused in REFUSED:  # out of --help: they are listed in docs/megatron-compat.md
        for flag in refused.flags:  # any number of values, so the refusal, not argparse, reports them
            parser.add_argument(flag, dest=_dest(flag), nargs="*", default=None, help=argparse.SUPPRESS)
    return parser


def check_compat(args: argparse.Namespace) -> None:
    """One ValueError naming the first refused flag of the command line."""
    for refused in REFUSED:
        for flag in refused.flags:
            if getattr(args, _dest(flag)) is not None:
                raise ValueError(f"{flag}: {refused.why}")
    if args.mlp_type != "standard":
        raise ValueError(f"--mlp-type {args.mlp_type}: residual MoE (PR-MoE) is not implemented here; drop it")
