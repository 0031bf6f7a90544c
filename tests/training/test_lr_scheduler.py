"""OptimizerParamScheduler: Megatron's closed-form lr / weight-decay schedules, checkpointing, flags."""
import argparse
import math

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.arguments.optimizer import add_optimizer_args
from megatron.training.arguments.scheduler import add_scheduler_args, scheduler_config_from_args
from megatron.training.lr_scheduler import OptimizerParamScheduler, SchedulerConfig, SchedulerMismatchError

MAX_LR, MIN_LR, INIT_LR, WARMUP, DECAY = 1e-3, 1e-4, 1e-5, 10, 110


def _optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    return get_megatron_optimizer(OptimizerConfig(lr=MAX_LR, weight_decay=0.1), [model], None, None)


def _scheduler(style, **kw):
    args = dict(init_lr=INIT_LR, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
                lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=DECAY)
    args.update(kw)
    return OptimizerParamScheduler(_optimizer(), SchedulerConfig(**args))


def _lr_at(sched, step):
    sched.step(step - sched.num_steps)
    return sched.get_lr()


def _expected(style, step):
    if step <= WARMUP:
        return INIT_LR + (MAX_LR - INIT_LR) * step / WARMUP
    if style == "constant":
        return MAX_LR
    if step > DECAY:
        return MIN_LR
    ratio = (step - WARMUP) / (DECAY - WARMUP)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return MIN_LR + coeff * (MAX_LR - MIN_LR)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_follows_closed_form(style):
    sched = _scheduler(style)
    assert sched.get_lr() == pytest.approx(INIT_LR, rel=1e-12)  # step 0 = start of warm-up
    for step in [3, 5, 10, 35, 60, 85, 109, 110, 111, 500]:
        assert _lr_at(sched, step) == pytest.approx(_expected(style, step), rel=1e-12, abs=1e-15), step
    # Hand-computed anchors so the test does not only restate the code.
    anchors = {"constant": {5: 5.05e-4, 60: 1e-3, 500: 1e-3},
               "linear": {5: 5.05e-4, 60: 5.5e-4, 35: 1e-4 + 0.75 * 9e-4, 110: 1e-4, 500: 1e-4},
               "cosine": {5: 5.05e-4, 60: 5.5e-4, 35: 1e-4 + 0.5 * (math.sqrt(0.5) + 1) * 9e-4, 110: 1e-4}}[style]
    for step, lr in anchors.items():
        assert _lr_at(sched, step) == pytest.approx(lr, rel=1e-9), (style, step)


def test_param_groups_get_lr_and_decay_multipliers():
    sched = _scheduler("linear")
    sched.step(WARMUP)
    groups = sched.optimizer.param_groups
    assert [g["lr"] for g in groups] == [pytest.approx(MAX_LR)] * 2
    decay = {g["wd_mult"]: g["weight_decay"] for g in groups}
    assert decay == {1.0: pytest.approx(0.1), 0.0: 0.0}
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment(style):
    sched = _scheduler("constant", start_wd=0.0, end_wd=0.2, wd_incr_steps=100, wd_incr_style=style)
    for step, ratio in [(0, 0.0), (25, 0.25), (50, 0.5), (100, 1.0)]:
        sched.step(step - sched.num_steps)
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
        assert sched.get_wd() == pytest.approx(0.2 * coeff, abs=1e-12)
        assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.2 * coeff, abs=1e-12)
    sched.step(50)
    assert sched.get_wd() == 0.2


def test_state_dict_resumes_and_a_different_schedule_needs_a_choice():
    sched = _scheduler("cosine")
    sched.step(42)
    state = sched.state_dict()
    resumed = _scheduler("cosine")
    resumed.load_state_dict(state)
    assert resumed.num_steps == 42 and resumed.get_lr() == sched.get_lr()
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(sched.get_lr())

    # Megatron's rule: neither flag -> an error naming both values and both flags.
    with pytest.raises(SchedulerMismatchError) as e:
        _scheduler("linear", max_lr=2e-3).load_state_dict(state)
    message = str(e.value)
    assert "max_lr 0.001 in the checkpoint, 0.002 from the flags (--lr)" in message
    assert "lr_decay_style 'cosine' in the checkpoint, 'linear' from the flags" in message
    assert "--override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message

    taken = _scheduler("linear", max_lr=2e-3, use_checkpoint_opt_param_scheduler=True)
    taken.load_state_dict(state)
    assert taken.config.max_lr == MAX_LR and taken.config.lr_decay_style == "cosine"
    assert taken.get_lr() == pytest.approx(sched.get_lr())

    kept = _scheduler("linear", max_lr=2e-3, override_opt_param_scheduler=True)
    kept.load_state_dict(state)
    assert kept.config.max_lr == 2e-3 and kept.config.lr_decay_style == "linear" and kept.num_steps == 42


def test_a_constant_weight_decay_ignores_its_length():
    """A longer run moves the weight-decay increment length, which a constant weight decay does not read."""
    state = _scheduler("cosine").state_dict()
    longer = _scheduler("cosine", wd_incr_steps=2 * DECAY)
    longer.load_state_dict(state)
    assert longer.config.wd_incr_steps == 2 * DECAY


def test_bad_schedules_are_rejected():
    with pytest.raises(ValueError, match="warm-up samples"):
        _scheduler("linear", lr_warmup_steps=DECAY)
    with pytest.raises(ValueError, match="lr-decay-style"):
        _scheduler("exponential")
    with pytest.raises(ValueError, match="constant needs equal"):
        _scheduler("linear", start_wd=0.0, end_wd=0.1)


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_optimizer_args(parser)
    add_scheduler_args(parser)
    return parser.parse_args(["--lr", "1e-3", "--min-lr", "1e-4"] + argv)


def _scheduler_from_args(argv, train_samples, global_batch_size=1, seq_length=1):
    return OptimizerParamScheduler(_optimizer(), scheduler_config_from_args(_parse(argv), train_samples,
                                                                             global_batch_size, seq_length))


def test_scheduler_from_args():
    sched = _scheduler_from_args(["--lr-warmup-fraction", "0.1", "--lr-decay-style", "cosine"], 200)
    c = sched.config
    assert (c.lr_warmup_steps, c.lr_decay_steps, c.lr_decay_style) == (20, 200, "cosine")
    assert c.start_wd == c.end_wd == 0.01 and c.wd_incr_steps == 200

    sched = _scheduler_from_args(["--lr-warmup-iters", "5", "--lr-decay-iters", "50", "--weight-decay-incr-style",
                                  "linear", "--start-weight-decay", "0.0", "--end-weight-decay", "0.1"],
                                 100)
    c = sched.config
    assert (c.lr_warmup_steps, c.lr_decay_steps, c.end_wd, c.wd_incr_style) == (5, 50, 0.1, "linear")
    sched.step(50)
    assert sched.get_lr() == pytest.approx(1e-4) and sched.get_wd() == pytest.approx(0.05)

    # Megatron's unit is the sample: iterations count global batches, tokens count --seq-length each.
    c = _scheduler_from_args(["--lr-warmup-iters", "5", "--lr-decay-tokens", "3200"], 1000, global_batch_size=8,
                             seq_length=16).config
    assert (c.lr_warmup_steps, c.lr_decay_steps, c.wd_incr_steps) == (40, 200, 1000)
    c = _scheduler_from_args(["--lr-warmup-samples", "30", "--lr-decay-samples", "300"], 1000, 8, 16).config
    assert (c.lr_warmup_steps, c.lr_decay_steps) == (30, 300)


def test_scheduler_from_args_errors():
    with pytest.raises(ValueError, match="exclusive"):
        scheduler_config_from_args(_parse(["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"]), 100, 1, 1)
    with pytest.raises(ValueError, match="needs both"):
        scheduler_config_from_args(_parse(["--weight-decay-incr-style", "cosine"]), 100, 1, 1)
    with pytest.raises(ValueError, match="incr-style linear or cosine"):
        scheduler_config_from_args(_parse(["--end-weight-decay", "0.1"]), 100, 1, 1)
    with pytest.raises(ValueError, match="--lr-decay-iters and --lr-decay-samples are exclusive"):
        scheduler_config_from_args(_parse(["--lr-decay-iters", "5", "--lr-decay-samples", "40"]), 100, 8, 1)
    with pytest.raises(ValueError, match="contradict"):
        scheduler_config_from_args(_parse(["--override-opt_param-scheduler",
                                           "--use-checkpoint-opt_param-scheduler"]), 100, 1, 1)


def test_a_constant_learning_rate_ignores_its_length():
    """A longer run moves the decay length (and may come with another --min-lr), which a constant learning rate
    does not read: the resume is taken and every step's lr, past and future, is the checkpoint's."""
    saved = _scheduler("constant")
    saved.step(42)
    longer = _scheduler("constant", lr_decay_steps=3 * DECAY, min_lr=0.0, wd_incr_steps=3 * DECAY)
    longer.load_state_dict(saved.state_dict())
    assert longer.num_steps == 42 and longer.config.lr_decay_steps == 3 * DECAY
    for step in (0, 5, WARMUP, 42, DECAY, 2 * DECAY, 3 * DECAY + 1):
        assert _lr_at(longer, step) == _lr_at(saved, step), step


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_a_decaying_learning_rate_still_needs_a_choice_for_a_longer_run(style):
    state = _scheduler(style).state_dict()
    with pytest.raises(SchedulerMismatchError, match=f"lr_decay_steps {DECAY} in the checkpoint, {2 * DECAY} from "):
        _scheduler(style, lr_decay_steps=2 * DECAY).load_state_dict(state)
    with pytest.raises(SchedulerMismatchError, match="lr_decay_style 'constant' in the checkpoint, 'cosine' from"):
        _scheduler("cosine", lr_decay_steps=2 * DECAY).load_state_dict(_scheduler("constant").state_dict())
    # A warm-up that changes with the run's length (--lr-warmup-fraction) changes past values: still refused.
    with pytest.raises(SchedulerMismatchError, match="lr_warmup_steps 10 in the checkpoint, 20 from"):
        _scheduler("constant", lr_warmup_steps=2 * WARMUP).load_state_dict(_scheduler("constant").state_dict())


def test_without_warm_up_the_warm_up_start_is_not_read():
    state = _scheduler("cosine", lr_warmup_steps=0).state_dict()
    _scheduler("cosine", lr_warmup_steps=0, init_lr=0.0).load_state_dict(state)
    with pytest.raises(SchedulerMismatchError, match="init_lr 1e-05 in the checkpoint, 0 from the flags"):
        _scheduler("cosine", init_lr=0.0).load_state_dict(_scheduler("cosine").state_dict())
