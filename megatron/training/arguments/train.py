"""Training-length, evaluation, logging and per-step housekeeping flags -> ``TrainConfig``, ``LogConfig``,
``HousekeepingConfig``."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os

from megatron.training.batch_schedule import BatchSchedule
from megatron.training.config import TrainConfig
from megatron.training.housekeeping import HousekeepingConfig
from megatron.training.run_log import default_log_file
from megatron.training.stragglers import StragglerConfig
from megatron.training.train_log import LogConfig


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=None, help="training length in iterations")
    g.add_argument("--train-samples", type=int, default=None,
                   help="training length in samples (instead of --train-iters)")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="stop once this many tokens are consumed (with --train-iters/--train-samples: whichever "
                        "comes first)")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1 finish the current step, save a checkpoint and exit 0; a second "
                        "signal stops at once")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save a checkpoint and exit once this many minutes have passed since the start")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss as a mean over all tokens of the step: accepted without --eod-mask-loss, where "
                        "every micro-batch counts all its tokens and the per-micro-batch mean is the same number")
    g.add_argument("--seed", type=int, default=1234)
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-file", default=None, metavar="PATH",
                   help="the logging rank also appends its log lines to this text file (default with --save or "
                        "--tensorboard-dir: <that directory>/logs/train-<UTC time>.log; else stdout only)")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events held before they are written to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="also write iteration-time (seconds per iteration) to TensorBoard / W&B")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="also write batch-size (the global batch size) to TensorBoard / W&B")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write the validation perplexity to TensorBoard / W&B")
    g.add_argument("--wandb-project", default=None,
                   help="log the same scalars to Weights & Biases under this project (needs: pip install wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name (needed with --wandb-project)")
    g.add_argument("--wandb-save-dir", default=None, help="where W&B keeps the run (default: <--save>/wandb)")
    g.add_argument("--wandb-entity", default=None, help="the W&B team or user (default: W&B's)")
    g.add_argument("--log-straggler", action="store_true",
                   help="at every log interval, time the same matmul probe on every rank and name a rank that is "
                        "slower than the median by --straggler-factor for --straggler-intervals intervals in a row")
    g.add_argument("--straggler-factor", type=float, default=1.25,
                   help="with --log-straggler: slower than the median rank by this factor counts (default 1.25)")
    g.add_argument("--straggler-intervals", type=int, default=3,
                   help="with --log-straggler: log intervals in a row a rank must be slow to be named (default 3)")
    g = parser.add_argument_group("per-step housekeeping")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collection off and collect at fixed points instead (same "
                        "moment on every rank)")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every this many iterations (0: only around evaluations)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: do not collect before and after each evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="1: return cached CUDA memory after every step; 2: also after every evaluation")
    g.add_argument("--profile", action="store_true",
                   help="CUDA profiler range (nsys --capture-range=cudaProfilerApi) from --profile-step-start to "
                        "--profile-step-end on --profile-ranks")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    return parser


def train_iters_from_args(args: argparse.Namespace, schedule: BatchSchedule) -> int:
    """The training length in iterations, from --train-iters, --train-samples and/or --train-tokens."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError("--train-iters and --train-samples both give the training length; pass one of them "
                         "(--train-tokens may go with either)")
    if args.train_iters is None and args.train_samples is None and args.train_tokens is None:
        raise ValueError("no training length: pass --train-iters, --train-samples or --train-tokens")
    for flag, value in (("--train-iters", args.train_iters), ("--train-samples", args.train_samples),
                        ("--train-tokens", args.train_tokens)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be > 0 (got {value})")
    iters = args.train_iters
    if args.train_samples is not None:
        iters = schedule.iterations_for(args.train_samples)
        if iters == 0:
            raise ValueError(f"--train-samples {args.train_samples} is less than one global batch "
                             f"({schedule.global_batch_size(0)}); train more samples")
    if args.train_tokens is not None:  # Megatron-DeepSpeed stops after the step that reaches the count
        by_tokens = schedule.iterations_for(math.ceil(args.train_tokens / args.seq_length), until_reached=True)
        iters = by_tokens if iters is None else min(iters, by_tokens)
    return iters


def train_samples_from_args(args: argparse.Namespace, train_iters: int, global_batch_size: int) -> int:
    """The training length in samples, the schedule's default decay length (Megatron: iterations x the global
    batch size, or --train-samples)."""
    if args.train_samples is not None:
        return args.train_samples
    if args.train_iters is not None:
        return args.train_iters * global_batch_size
    return math.ceil(args.train_tokens / args.seq_length)


def train_config_from_args(args: argparse.Namespace, train_iters: int) -> TrainConfig:
    if args.calculate_per_token_loss and args.eod_mask_loss:
        raise ValueError("--calculate-per-token-loss with --eod-mask-loss: the loss is averaged per micro-batch "
                         "here, which differs from a per-token mean once masked tokens vary; drop one of them")
    return TrainConfig(train_iters=train_iters, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                       log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir, seed=args.seed,
                       exit_interval=args.exit_interval,
                       exit_signal_handler=args.exit_signal_handler, exit_duration_in_mins=args.exit_duration_in_mins)


def log_config_from_args(args: argparse.Namespace) -> LogConfig:
    if args.wandb_project:
        if not args.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name (the run's name in the project)")
        if importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs the wandb package, which is not installed: pip install wandb")
    save_dir = args.wandb_save_dir
    if save_dir is None and args.save:
        save_dir = os.path.join(args.save, "wandb")
    log_file = args.log_file
    if log_file is not None and os.path.isdir(log_file):
        raise ValueError(f"--log-file {log_file} is a directory; give a file path, e.g. {default_log_file(log_file)}")
    if log_file is None and (args.save or args.tensorboard_dir):  # the run's directory: its checkpoints first
        log_file = default_log_file(args.save or args.tensorboard_dir)
    return LogConfig(tensorboard_queue_size=args.tensorboard_queue_size,
                     log_timers=args.log_timers_to_tensorboard, log_batch_size=args.log_batch_size_to_tensorboard,
                     log_validation_ppl=args.log_validation_ppl_to_tensorboard, wandb_project=args.wandb_project,
                     wandb_exp_name=args.wandb_exp_name, wandb_save_dir=save_dir, wandb_entity=args.wandb_entity,
                     log_file=log_file)


def straggler_config_from_args(args: argparse.Namespace) -> StragglerConfig | None:
    if not args.log_straggler:
        return None
    return StragglerConfig(factor=args.straggler_factor, intervals=args.straggler_intervals)


def housekeeping_config_from_args(args: argparse.Namespace) -> HousekeepingConfig:
    return HousekeepingConfig(manual_gc=args.manual_gc, manual_gc_interval=args.manual_gc_interval,
                              manual_gc_eval=args.manual_gc_eval,
                              empty_unused_memory_level=args.empty_unused_memory_level, profile=args.profile,
                              profile_step_start=args.profile_step_start, profile_step_end=args.profile_step_end,
                              profile_ranks=tuple(args.profile_ranks))
