"""The flag sets of real Megatron-LM and Megatron-DeepSpeed launch scripts, as those scripts pass them, with only
paths and sizes changed (tiny model, 3 iterations, the bundled sample corpus or mock data, 1-2 CPU ranks):

- Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh (today's, with --step-batch-size-schedule, and the
  one before 2026-04, with --rampup-batch-size) and examples/llama/train_llama3_8b_h100_fp8.sh (its DTYPE switch
  at bf16; the fp8 and decoupled-lr flags it also passes are refused, see REFUSED_IN_SCRIPTS);
- Megatron-DeepSpeed examples_deepspeed/rebase/ds_pretrain_gpt_125M.sh (dense, ZeRO-1 with pipeline stages),
  MoE/ds_pretrain_gpt_1.3B_dense.sh (its MoE flags at one expert, batch ramp-up, ZeRO stage 0) and
  pretrain_llama2_distributed.sh (torchrun, with its W&B switch on); MoE/ds_pretrain_gpt_125M_MoE64.sh,
  MoE/ds_pretrain_gpt_1.3B_PR-MoE64or128_MoS.sh and rebase/ds_pretrain_gpt_1.3B_rope.sh ask for what is
  refused here (REFUSED_IN_SCRIPTS).

docs/megatron-compat.md has a row for every flag listed here.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"
CORPUS, VOCAB, MERGES = str(SAMPLE / "corpus_text_document"), str(SAMPLE / "vocab.json"), str(SAMPLE / "merges.txt")
ITERS = 3

# Megatron-DeepSpeed's examples_deepspeed/rebase/ds_config_gpt_TEMPLATE.json and MoE/ds_config_gpt_TEMPLATE.json,
# filled in as the scripts' sed lines do.
DS_REBASE_TEMPLATE = {"train_batch_size": "GBSIZE", "train_micro_batch_size_per_gpu": "MBSIZE",
                      "steps_per_print": "LOG_INTERVAL", "zero_optimization": {"stage": "ZERO_STAGE"},
                      "gradient_clipping": 1.0, "prescale_gradients": "PRESCALE_GRAD",
                      "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                               "min_loss_scale": 1, "initial_scale_power": 11},
                      "wall_clock_breakdown": False}
DS_MOE_TEMPLATE = {"train_batch_size": "CONFIG_BATCH_SIZE", "train_micro_batch_size_per_gpu": "CONFIG_MBSIZE",
                   "steps_per_print": "LOG_INTERVAL", "zero_optimization": {"stage": "ZERO_STAGE"},
                   "gradient_clipping": 1.0, "prescale_gradients": "PRESCALE_GRAD",
                   "fp16": {"enabled": "CONFIG_FP16_ENABLED", "loss_scale": 0, "loss_scale_window": 500,
                            "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 11},
                   "bf16": {"enabled": "CONFIG_BF16_ENABLED"},
                   "curriculum_learning": {"enabled": "CONFIG_CL_ENABLED", "curriculum_type": "seqlen",
                                           "min_difficulty": "CONFIG_CL_MIN", "max_difficulty": "CONFIG_CL_MAX",
                                           "schedule_type": "fixed_linear",
                                           "schedule_config": {"total_curriculum_step": "CONFIG_CL_DURATION",
                                                               "difficulty_step": 8}},
                   "wall_clock_breakdown": False}


def _fill(template, values: dict):
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    return values.get(template, template) if isinstance(template, str) else template


def write_json(path: Path, template: dict, values: dict) -> str:
    path.write_text(json.dumps(_fill(template, values)))
    return str(path)


def gpt3_175b(tmp: Path, ramp: bool = False) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh; 2 ranks (TP 8 x PP 16 -> PP 2)."""
    batch = ["--rampup-batch-size", "4", "4", "8"] if ramp else ["--step-batch-size-schedule", "0:4 64:8"]
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "8", *batch, "--train-iters", str(ITERS),
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
        "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "30",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--data-path", CORPUS, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--eval-iters", "1",
        "--tensorboard-dir", str(tmp / "tb"),
    ]


LLAMA3_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
              "--fp8-param-gather"]
LLAMA3_DECOUPLED_LR = ["--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5"]


def llama3_8b(tmp: Path, attention_backend: str = "fused") -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh with DTYPE=bf16, mock data; 2 ranks (DP 2). Without its
    --decoupled-lr pair (refused). ``attention_backend``: the script's fused, where the device has it."""
    return [
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--seq-length", "16", "--max-position-embeddings", "16", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend",
        attention_backend, "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", str(4 * ITERS),
        "--lr-decay-samples", "12", "--lr-warmup-samples", "4", "--lr", "0.00015", "--min-lr", "0.00001",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins",
        "235", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        # The mock-data branch, expanded as bash expands "${DATA_ARGS_LIST[@]}" unquoted: '99,1,0' keeps its quotes.
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-cache-path",
        str(tmp / "cache"), "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
        "torch_dist", "--distributed-timeout-minutes", "60", "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"),
        "--tensorboard-dir", str(tmp / "tb"),
    ]


def mds_gpt_125m(tmp: Path) -> list[str]:
    """examples_deepspeed/rebase/ds_pretrain_gpt_125M.sh (ZeRO-1, pipeline stages); 2 ranks (TP 2 x PP 2 -> PP 2)."""
    ds = write_json(tmp / "ds_rebase.json", DS_REBASE_TEMPLATE,
                    {"GBSIZE": 4, "MBSIZE": 2, "LOG_INTERVAL": 1, "ZERO_STAGE": 1, "PRESCALE_GRAD": False})
    return [
        "--vocab-file", VOCAB, "--merge-file", MERGES, "--data-path", CORPUS, "--data-impl", "mmap",
        "--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", "1", "--init-method-std", "0.02", "--lr-decay-tokens", "480",
        "--lr-warmup-tokens", "48", "--micro-batch-size", "2", "--exit-duration-in-mins", "30000000",
        "--global-batch-size", "4", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-tokens", str(ITERS * 4 * 16),
        "--train-samples", "48", "--lr", "6.0e-4", "--min-lr", "1.0e-6", "--lr-decay-style", "cosine",
        "--split", "949,50,1", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
        "--save-interval", "100", "--weight-decay", "0.1", "--clip-grad", "1.0", "--hysteresis", "2",
        "--num-workers", "0", "--fp16", "--seed", "1234", "--load", str(tmp / "ckpt"), "--save", str(tmp / "ckpt"),
        "--no-async-tensor-model-parallel-allreduce", "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--tensorboard-dir",
        str(tmp / "tb"), "--checkpoint-activations", "--log-optimizer-states-to-tensorboard",
        "--deepspeed", "--deepspeed_config", ds, "--zero-stage", "1", "--pipeline-model-parallel-size", "2",
        "--deepspeed-activation-checkpointing",
    ]


def _mds_moe_options(experts: int) -> list[str]:
    return ["--moe-expert-parallel-size", str(experts), "--num-experts", str(experts), "--moe-loss-coeff", "0.01",
            "--moe-train-capacity-factor", "1.0", "--moe-eval-capacity-factor", "1.0", "--moe-min-capacity", "4"]


def mds_moe_dense_1_3b(tmp: Path) -> list[str]:
    """examples_deepspeed/MoE/ds_pretrain_gpt_1.3B_dense.sh (EP_SIZE=1, ramp-up, ZeRO stage 0); 2 ranks (TP 4 ->
    TP 2)."""
    ds = write_json(tmp / "ds_moe.json", DS_MOE_TEMPLATE,
                    {"CONFIG_BATCH_SIZE": 4, "CONFIG_MBSIZE": 1, "LOG_INTERVAL": 1, "ZERO_STAGE": 0,
                     "PRESCALE_GRAD": True, "CONFIG_FP16_ENABLED": True, "CONFIG_BF16_ENABLED": False,
                     "CONFIG_CL_ENABLED": False, "CONFIG_CL_MIN": 80, "CONFIG_CL_MAX": 16, "CONFIG_CL_DURATION": 10})
    return [
        "--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", "2", *_mds_moe_options(1), "--init-method-std", "0.014",
        "--lr-decay-tokens", "960", "--lr-warmup-tokens", "32", "--micro-batch-size", "1",
        "--exit-duration-in-mins", "30000000", "--rampup-batch-size", "2", "2", "4", "--global-batch-size", "4",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--train-tokens", "100000", "--train-samples", "8", "--lr", "2.0e-4",
        "--min-lr", "2.0e-06", "--lr-decay-style", "cosine", "--split", "98,2,0", "--log-interval", "1",
        "--eval-interval", "100", "--eval-iters", "1", "--save-interval", "10000", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--hysteresis", "2", "--num-workers", "0", "--fp16", "--load", str(tmp / "ckpt"),
        "--save", str(tmp / "ckpt"), "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--tensorboard-dir",
        str(tmp / "tb"), "--checkpoint-activations",
        "--vocab-file", VOCAB, "--merge-file", MERGES, "--data-path", CORPUS, "--data-impl", "mmap",
        "--deepspeed", "--deepspeed_config", ds, "--pipeline-model-parallel-size", "1",
        "--deepspeed-activation-checkpointing",
    ]


def mds_llama2(tmp: Path) -> list[str]:
    """examples_deepspeed/pretrain_llama2_distributed.sh (LOG_TO_WANDB=1, activation_checkpoint=true, ZeRO stage 0),
    mock data instead of its SentencePiece corpus; 2 ranks (TP 2 x PP 2 -> PP 2)."""
    ds = tmp / "deepspeed.json"
    ds.write_text(json.dumps({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
                              "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}))
    return [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
        "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--seq-length", "16", "--max-position-embeddings", "16",
        "--train-iters", str(ITERS), "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"),
        "--mock-data", "--data-impl", "mmap", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--split", "949,50,1", "--distributed-backend", "gloo", "--lr", "3e-4", "--lr-decay-style", "cosine",
        "--min-lr", "3e-5", "--weight-decay", "0.1", "--clip-grad", "1", "--lr-warmup-iters", "1",
        "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
        "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "1", "--bf16",
        "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--swiglu", "--normalization",
        "rmsnorm", "--disable-bias-linear", "--num-key-value-heads", "2",
        "--wandb-project", "pretrain-llama2", "--wandb-exp-name", "exp0", "--wandb-save-dir", str(tmp / "wandb"),
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--deepspeed-activation-checkpointing",
        f"--zero-stage={0}", f"--deepspeed_config={ds}", "--deepspeed",
    ]


# Flags of the scripts above (their other settings, or sibling scripts) that ask for what is refused here:
# (flags, the start of the one-line error).
REFUSED_IN_SCRIPTS = [
    (LLAMA3_FP8, "--fp8-format: FP8 training (Transformer Engine) is not implemented here"),
    (LLAMA3_DECOUPLED_LR, "--decoupled-lr: a separate learning rate for the embedding and output layers"),
    (["--disable-moe-token-dropping", "--num-experts", "128", "64"],
     "--num-experts 128 64: a different expert count per layer (Megatron-DeepSpeed's pyramid MoE)"),
    (["--mos", "--kd-beta-ce", "1", "--num-layers-teacher", "24", "--hidden-size-teacher", "2048",
      "--num-attention-heads-teacher", "16", "--num-experts-teacher", "128", "--load-teacher", "/teacher"],
     "--mos: knowledge distillation"),
    (["--mlp-type", "residual"], "--mlp-type residual: residual MoE (PR-MoE) is not implemented here"),
    (["--use-rotary-position-embeddings", "--rotary-percent", "0.25"], "--rotary-percent 0.25: partial rotary"),
    (["--use-flash-attn", "--attention-backend", "unfused"], "--use-flash-attn and --attention-backend unfused"),
]

def mds_moe_4(tmp: Path) -> list[str]:
    """examples_deepspeed/MoE/ds_pretrain_gpt_1.3B_MoE128.sh with 4 experts over EP 2 (128 over 64), TP 1,
    ZeRO stage 0, fp32 here; 2 ranks."""
    argv = mds_moe_dense_1_3b(tmp)
    argv[argv.index("--moe-expert-parallel-size"):argv.index("--moe-expert-parallel-size") + 14] = \
        _mds_moe_options(2)
    argv[argv.index("--num-experts") + 1] = "4"
    argv[argv.index("--tensor-model-parallel-size") + 1] = "1"  # TP 1, so that the 2 ranks are EP 2
    argv.remove("--fp16")
    argv[argv.index("--deepspeed_config") + 1] = write_json(
        tmp / "ds_moe_fp32.json", DS_MOE_TEMPLATE,
        {"CONFIG_BATCH_SIZE": 4, "CONFIG_MBSIZE": 1, "LOG_INTERVAL": 1, "ZERO_STAGE": 0, "PRESCALE_GRAD": True,
         "CONFIG_FP16_ENABLED": False, "CONFIG_BF16_ENABLED": False, "CONFIG_CL_ENABLED": False, "CONFIG_CL_MIN": 80,
         "CONFIG_CL_MAX": 16, "CONFIG_CL_DURATION": 10})
    return argv + ["--create-moe-param-group", "--moe-min-capacity", "4", "--topk", "2"]


SCRIPTS = {"gpt3_175b": (gpt3_175b, 2), "gpt3_175b_rampup": (lambda tmp: gpt3_175b(tmp, ramp=True), 2),
           "llama3_8b": (llama3_8b, 2), "mds_gpt_125m": (mds_gpt_125m, 2),
           "mds_moe_dense_1_3b": (mds_moe_dense_1_3b, 2), "mds_moe_4": (mds_moe_4, 2), "mds_llama2": (mds_llama2, 2)}
