"""The trainer's configuration: typed, frozen, built once by ``arguments.parse_args`` and passed explicitly.

The subsystems' own configs live next to their code (``OptimizerConfig``, ``SchedulerConfig``,
``DataConfig``, ``TokenizerConfig``, ``CheckpointConfig``, the engine's ``ZeroCacheConfig``); ``Config``
bundles them with the ones here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from megatron.core.moe.config import MoEConfig
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.pipeline_parallel.rounds import SCHEDULES
from megatron.core.transformer_config import CP_COMM_TYPES, TransformerConfig
from megatron.data.config import DataConfig
from megatron.tokenizer.config import TokenizerConfig
from megatron.training.attention_backend import ATTENTION_BACKENDS
from megatron.training.batch_schedule import BatchSchedule
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.housekeeping import HousekeepingConfig
from megatron.training.lr_scheduler import SchedulerConfig
from megatron.training.stragglers import StragglerConfig
from megatron.training.train_log import LogConfig
from zero_cache.config import ZeroCacheConfig

FlagValue = int | float | str | bool | None


class ConfigError(ValueError):
    """Bad command line: printed as one line, exit code 2."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Pad the vocabulary so every tensor-parallel shard of the embedding has the same, aligned size."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and numerics from the command line: a ``TransformerConfig`` but for the padded
    vocabulary, which is known once the tokenizer is built (see ``transformer_config``)."""
    num_layers: int  # transformer layers of the whole model
    hidden_size: int  # width of the residual stream
    num_attention_heads: int
    seq_length: int  # tokens per sample
    ffn_hidden_size: int | None = None  # None: 4 x hidden_size
    num_query_groups: int | None = None  # grouped-query attention; None: one group per head
    kv_channels: int | None = None  # None: hidden_size / num_attention_heads
    max_position_embeddings: int | None = None  # None: seq_length
    make_vocab_size_divisible_by: int = 128  # each tensor-parallel shard of the vocabulary is a multiple of this
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0  # rope frequency base
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5  # --norm-epsilon
    swiglu: bool = False  # gated (SwiGLU) MLP instead of GeLU
    openai_gelu: bool = False  # GELU's tanh approximation (GPT-2's gelu_new) instead of the exact form
    add_bias_linear: bool = True  # biases in the attention and MLP projections
    add_qkv_bias: bool = False  # biases on the QKV projection only (Qwen2)
    untie_embeddings_and_output_weights: bool = False  # a separate output head instead of the word embedding
    hidden_dropout: float = 0.1  # dropout on the embeddings and the attention / MLP outputs
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    init_method_std: float = 0.02  # std of the normal weight initialisation
    precision: str = "fp32"  # parameter dtype: fp32 | bf16 | fp16
    recompute_granularity: str | None = None  # "full": recompute each layer's activations in backward
    recompute_method: str = "uniform"  # uniform | block
    recompute_num_layers: int = 1  # layers per recompute chunk (uniform) or recomputed layers per stage (block)
    cpu_offloading_num_layers: int = 0  # layers per model chunk whose activations go to host; -1: all but the last
    seed: int = 1234  # weights are initialised from (seed, parameter name)
    gradient_accumulation_fusion: bool = True  # linear/embedding layers add weight gradients into the buffers
    attention_backend: str = "auto"  # scaled_dot_product_attention's kernel (attention_backend.py); not the model's
    compile: bool = False  # --compile: torch.compile each dense transformer layer (training/compile.py)
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (--num-experts ...); None: dense

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: choose one of {ATTENTION_BACKENDS}")
        # TransformerConfig checks the shape now, so a bad one fails before start-up; no check reads the vocabulary.
        self.transformer_config(vocab_size=1, tensor_model_parallel_size=1)

    def transformer_config(self, vocab_size: int, tensor_model_parallel_size: int) -> TransformerConfig:
        """The model for a tokenizer of ``vocab_size`` ids, its vocabulary padded for the tensor-parallel size."""
        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            seq_length=self.seq_length,
            padded_vocab_size=padded_vocab_size(vocab_size, self.make_vocab_size_divisible_by,
                                                tensor_model_parallel_size),
            ffn_hidden_size=self.ffn_hidden_size, num_query_groups=self.num_query_groups, kv_channels=self.kv_channels,
            max_position_embeddings=self.max_position_embeddings, position_embedding_type=self.position_embedding_type,
            rotary_base=self.rotary_base, normalization=self.normalization, layernorm_epsilon=self.layernorm_epsilon,
            swiglu=self.swiglu, openai_gelu=self.openai_gelu, add_bias_linear=self.add_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            untie_embeddings_and_output_weights=self.untie_embeddings_and_output_weights,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            init_method_std=self.init_method_std, precision=self.precision,
            recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
            recompute_num_layers=self.recompute_num_layers, seed=self.seed,
            cpu_offloading_num_layers=self.cpu_offloading_num_layers,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion, moe=self.moe)


@dataclass(frozen=True)
class ParallelConfig:
    """The tensor x context x data x pipeline mesh and the batch it splits."""
    tensor_model_parallel_size: int  # ranks that split each layer's matrices
    pipeline_model_parallel_size: int  # stages the layers are split into
    data_parallel_size: int  # world size / (tensor x context x pipeline)
    micro_batch_size: int  # samples per forward/backward on one data-parallel rank
    global_batch_size: int  # samples per optimizer step, over all data-parallel ranks
    distributed_backend: str | None  # nccl | gloo; None: nccl when CUDA is available, else gloo
    distributed_timeout_minutes: float  # how long a collective may wait for its peers (start-up, checkpoints)
    # --rampup-batch-size / --step-batch-size-schedule; None: every step takes global_batch_size samples
    batch_schedule: BatchSchedule | None = None
    expert_model_parallel_size: int = 1  # ranks that split the experts, inside the data-parallel group
    context_parallel_size: int = 1  # ranks that split every sequence (megatron/core/context_parallel/)
    cp_comm_type: str = "p2p"  # context-parallel attention: p2p (ring) | a2a (all-to-all, Ulysses)
    sequence_parallel: bool = False  # TP ranks split the sequence outside the tensor-parallel regions
    virtual_pipeline_model_parallel_size: int | None = None  # model chunks per stage (interleaved 1F1B); None: 1
    pipeline_schedule: str = "1f1b"  # --pipeline-schedule (megatron.core.pipeline_parallel.schedules.SCHEDULES)
    train_timeout_seconds: float | None = None  # the same after the first step; None: distributed_timeout_minutes

    @property
    def virtual_stages(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    def __post_init__(self):
        if self.expert_model_parallel_size < 1 or self.data_parallel_size % self.expert_model_parallel_size:
            raise ValueError(f"--expert-model-parallel-size {self.expert_model_parallel_size} must divide the "
                             f"data-parallel size {self.data_parallel_size} (experts are split inside data "
                             "parallelism); launch more ranks or choose a divisor")
        if self.micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0 (got {self.micro_batch_size})")
        if self.distributed_timeout_minutes <= 0 or (self.train_timeout_seconds or 0) < 0:
            raise ValueError(f"--distributed-timeout-minutes must be > 0 and --train-timeout-seconds >= 0 (got "
                             f"{self.distributed_timeout_minutes:g}, {self.train_timeout_seconds or 0:g})")
        per_step = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {self.data_parallel_size} = {per_step}; "
                f"use a multiple of {per_step}")
        self._check_pipeline_schedule()
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {self.cp_comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)}")
        # Checked for every size now rather than when the schedule reaches it, hours into the run.
        bad = [size for size in self.schedule.sizes() if size % per_step]
        if bad:
            raise ValueError(
                f"the batch-size schedule reaches global batch size {bad[0]}, not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {self.data_parallel_size} = {per_step}; make every "
                f"size of --rampup-batch-size / --step-batch-size-schedule a multiple of {per_step}")
        pp = self.pipeline_model_parallel_size
        uneven = [size for size in self.schedule.sizes() if (size // per_step) % pp]
        if self.virtual_stages > 1 and uneven:
            raise ValueError(
                f"the interleaved schedule needs the micro-batches of every step to be a multiple of "
                f"--pipeline-model-parallel-size {pp}, but global batch size {uneven[0]} makes "
                f"{uneven[0] // per_step}; use a global batch size that is a multiple of {per_step * pp}")

    def _check_pipeline_schedule(self) -> None:
        name, pp, v = self.pipeline_schedule, self.pipeline_model_parallel_size, self.virtual_stages
        if name not in SCHEDULES:
            raise ValueError(f"--pipeline-schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
        if name == "interleaved-1f1b" and v == 1:
            raise ValueError("--pipeline-schedule interleaved-1f1b needs several model chunks per stage: add "
                             "--virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage")
        if name != "interleaved-1f1b" and v > 1:
            raise ValueError(f"--pipeline-schedule {name} runs one model chunk per stage, but the virtual-pipeline "
                             f"flags ask for {v}: drop them or use interleaved-1f1b")
        if name == "zb-h1" and pp < 2:
            raise ValueError("--pipeline-schedule zb-h1 (--enable-zero-bubble) schedules a pipeline: it needs "
                             "--pipeline-model-parallel-size > 1")

    @property
    def schedule(self) -> BatchSchedule:
        return self.batch_schedule or BatchSchedule(self.global_batch_size)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of a step of the full global batch size."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class TrainConfig:
    """How long to train, when to evaluate and log."""
    train_iters: int  # optimizer steps to train for (resolved from --train-iters / -samples / -tokens)
    eval_interval: int  # iterations between evaluations on the validation split
    eval_iters: int  # batches per evaluation (0: no evaluation)
    log_interval: int  # iterations between log lines
    tensorboard_dir: str | None  # where TensorBoard scalars go (None: none written)
    seed: int  # data order, dropout and (through ModelConfig) weight initialisation
    exit_interval: int | None  # stop at the first iteration divisible by this (None: run train_iters)
    exit_signal_handler: bool = False  # SIGTERM / SIGUSR1: finish the step, save a checkpoint, exit 0
    exit_duration_in_mins: float | None = None  # save and exit before this much wall-clock time has passed

    def __post_init__(self):
        for name in ("train_iters", "log_interval", "eval_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ValueError(f"--exit-duration-in-mins must be > 0 (got {self.exit_duration_in_mins})")


@dataclass(frozen=True)
class DeepSpeedFlags:
    """How model states are sharded: ``--deepspeed`` trains through the zero_cache engine configured by a
    DeepSpeed-style JSON; ``--use-distributed-optimizer`` is Megatron's sharded optimizer, here ZeRO-1 through
    the same engine; neither: Megatron DDP."""
    enabled: bool  # --deepspeed
    config_path: str | None  # --deepspeed_config: the JSON file
    zero_stage: int | None  # --zero-stage: overrides zero_optimization.stage of the JSON (None: keep it)
    distributed_optimizer: bool = False  # --use-distributed-optimizer

    def __post_init__(self):
        if self.enabled and not self.config_path:
            raise ValueError("--deepspeed needs --deepspeed_config FILE (a DeepSpeed-style JSON)")
        # Megatron-DeepSpeed ignores a config given without --deepspeed and trains plain data-parallel, which
        # is never what the command line asked for.
        if not self.enabled and self.config_path:
            raise ValueError(f"--deepspeed_config {self.config_path} without --deepspeed would be ignored and the run "
                             "would train plain data-parallel; add --deepspeed to train through zero_cache, or drop "
                             "--deepspeed_config")
        if not self.enabled and self.zero_stage:
            raise ValueError(f"--zero-stage {self.zero_stage} without --deepspeed would be ignored and the run would "
                             "train plain data-parallel; add --deepspeed --deepspeed_config FILE, use "
                             "--use-distributed-optimizer (ZeRO-1), or drop --zero-stage")
        if self.config_path and not os.path.isfile(self.config_path):
            what = "a directory; give the JSON file" if os.path.isdir(self.config_path) else "no such file"
            raise ValueError(f"--deepspeed_config {self.config_path}: {what}")


@dataclass(frozen=True)
class Config:
    """Everything ``parse_args`` resolved, one config per subsystem."""
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    deepspeed: DeepSpeedFlags
    log: LogConfig = LogConfig()
    housekeeping: HousekeepingConfig = HousekeepingConfig()
    stragglers: StragglerConfig | None = None  # --log-straggler; None: no straggler check
    # The zero_cache engine's config (zero_config.py): --deepspeed's JSON merged with the flags and parsed once,
    # or ZeRO-1 for --use-distributed-optimizer; None: Megatron DDP (also --deepspeed with ZeRO stage 0)
    zero_cache: ZeroCacheConfig | None = None
    flags: tuple[tuple[str, FlagValue], ...] = ()  # every scalar flag by Megatron name, as resolved by parse_args

    def __post_init__(self):
        if self.zero_cache is not None and not (self.deepspeed.enabled or self.deepspeed.distributed_optimizer):
            raise ValueError("Config.zero_cache is the engine's config: only with --deepspeed or "
                             "--use-distributed-optimizer")

    def to_megatron_args(self, model: TransformerConfig, vocab_size: int | None = None) -> dict[str, FlagValue]:
        """The plain ``args`` dict stored in checkpoints (Megatron's names), as the conversion tools read it:
        the flags, with the model's resolved sizes, the tokenizer's vocabulary (``true_vocab_size``) and the
        mesh."""
        out = dict(self.flags)
        out.update(
            num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
            num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
            kv_channels=model.kv_channels, seq_length=model.seq_length,
            max_position_embeddings=model.max_position_embeddings, padded_vocab_size=model.padded_vocab_size,
            position_embedding_type=model.position_embedding_type, normalization=model.normalization,
            swiglu=model.swiglu, openai_gelu=model.openai_gelu, add_bias_linear=model.add_bias_linear,
            untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
            layernorm_epsilon=model.layernorm_epsilon, rotary_base=model.rotary_base,
            add_qkv_bias=model.add_qkv_bias, expert_model_parallel_size=self.parallel.expert_model_parallel_size,
            tensor_model_parallel_size=self.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.parallel.pipeline_model_parallel_size,
            data_parallel_size=self.parallel.data_parallel_size,
            context_parallel_size=self.parallel.context_parallel_size,
            virtual_pipeline_model_parallel_size=self.parallel.virtual_pipeline_model_parallel_size,
        )
        if vocab_size is not None:
            out["true_vocab_size"] = vocab_size
        return out
