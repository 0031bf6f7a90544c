"""Resuming with a learning-rate schedule that differs from the checkpoint's (here: --train-iters 20 -> 30, so the
decay length grows) is Megatron's choice to make explicit: an error naming both values and the two flags;
--override-opt_param-scheduler trains on the flags' schedule (iteration 21 is not at min-lr, the bug this
guards against); --use-checkpoint-opt_param-scheduler continues the checkpoint's (decayed: min-lr).
--use-checkpoint-args takes the model's shape from the same checkpoint."""
from __future__ import annotations

import math
import shutil

import pytest

from megatron.training.arguments import parse_args
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import TINY_GPT
from tests.training.run_trainer import run

pytestmark = pytest.mark.multiprocess

LR, MIN_LR, WARMUP_ITERS, GBS = 5e-3, 5e-4, 2, 8  # TINY_GPT's schedule: cosine, 2 warm-up iterations, batch 8


def _with(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def _argv(ckpt, iters: int, extra=()) -> list[str]:
    return _with(TINY_GPT, "--train-iters", str(iters)) + ["--save", str(ckpt), "--load", str(ckpt),
                                                           "--log-interval", "1", *extra]


def _train(rank, world, argv):
    from pretrain_gpt import main
    return main(argv).lrs


def _cosine_lr(samples: int, decay_samples: int) -> float:
    warmup = WARMUP_ITERS * GBS
    ratio = (samples - warmup) / (decay_samples - warmup)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1) * (LR - MIN_LR)


@pytest.fixture(scope="module")
def trained_20(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("schedule") / "ckpt"
    lrs = run_distributed(_train, 1, _argv(ckpt, 20))[0]
    assert sorted(lrs) == list(range(1, 21))
    return ckpt


def _resume(trained_20, tmp_path, extra):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained_20, ckpt)
    return ckpt, _argv(ckpt, 30, extra)


def test_a_different_schedule_without_a_choice_is_one_line(trained_20, tmp_path):
    _, argv = _resume(trained_20, tmp_path, [])
    code, out = run(argv)
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert code == 2 and "Traceback" not in out, out
    assert len(errors) == 1, out
    assert errors[0].startswith("pretrain_gpt.py: error: the learning-rate schedule differs from the checkpoint's: "
                                "lr_decay_steps 160 in the checkpoint, 240 from the flags"), errors[0]
    assert "--override-opt_param-scheduler" in errors[0] and "--use-checkpoint-opt_param-scheduler" in errors[0]


def test_override_trains_on_the_flags_schedule(trained_20, tmp_path):
    _, argv = _resume(trained_20, tmp_path, ["--override-opt_param-scheduler"])
    lrs = run_distributed(_train, 1, argv)[0]
    assert sorted(lrs) == list(range(21, 31))
    for it in (21, 25, 30):  # the lr of iteration i is the schedule's after i - 1 iterations
        assert lrs[it] == pytest.approx(_cosine_lr((it - 1) * GBS, 30 * GBS), rel=1e-12), it
    assert lrs[21] > 3 * MIN_LR  # mid-decay, not at the end of the checkpoint's schedule


def test_use_checkpoint_continues_the_checkpoints_schedule(trained_20, tmp_path):
    _, argv = _resume(trained_20, tmp_path, ["--use-checkpoint-opt_param-scheduler"])
    lrs = run_distributed(_train, 1, argv)[0]
    assert sorted(lrs) == list(range(21, 31))
    assert all(lr == pytest.approx(MIN_LR, rel=1e-12) for lr in lrs.values()), lrs  # decayed over 20 iterations


def _without(argv, *flags):
    for flag in flags:
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2:]
    return argv


def test_use_checkpoint_args_takes_the_models_shape_from_the_checkpoint(trained_20):
    shape = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings")
    argv = _without(_argv(trained_20, 30), *shape) + ["--use-checkpoint-args"]
    m = parse_args(argv, world_size=1).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 32, 4, 16)
    m = parse_args(argv + ["--hidden-size", "64"], world_size=1).model  # the checkpoint's shape wins, as in Megatron
    assert m.hidden_size == 32


def test_a_constant_learning_rate_run_extends_with_a_larger_train_iters(tmp_path):
    """Nothing in a constant schedule depends on the run's length: saved at iteration 4, the run goes on to 8
    without a schedule flag, at the same learning rate (cosine's refusal above is unchanged)."""
    ckpt = tmp_path / "ckpt"
    first = run_distributed(_train, 1, _with(_argv(ckpt, 4), "--lr-decay-style", "constant"))[0]
    assert sorted(first) == [1, 2, 3, 4]
    longer = _with(_with(_argv(ckpt, 8), "--lr-decay-style", "constant"), "--min-lr", "0")  # min-lr: not read
    lrs = run_distributed(_train, 1, longer)[0]
    assert sorted(lrs) == [5, 6, 7, 8]
    assert all(lr == pytest.approx(LR, rel=1e-12) for lr in lrs.values()), lrs
