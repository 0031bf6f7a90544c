"""Training-length, evaluation and logging flags -> ``TrainConfig``."""
from __future__ import annotations

import argparse

from megatron.training.config import TrainConfig


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1 finish the current step, save a checkpoint and exit 0; a second "
                        "signal stops at once")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save a checkpoint and exit once this many minutes have passed since the start")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--seed", type=int, default=1234)
    return parser


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(train_iters=args.train_iters, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                       log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir, seed=args.seed,
                       exit_interval=args.exit_interval, exit_signal_handler=args.exit_signal_handler,
                       exit_duration_in_mins=args.exit_duration_in_mins)
