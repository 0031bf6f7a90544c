"""Bad command lines are one line naming the problem and the fix, exit code 2, on every rank and without usage dumps
or tracebacks; --help shows every flag's default."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron.training.arguments import ConfigError, build_parser, parse_args
from tests.training.parallel_harness import TINY_GPT
from tests.training.run_trainer import ROOT

ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("extra, expected", [
    (["--lr-decay-iter", "5"], "unknown flag --lr-decay-iter; did you mean --lr-decay-iters?"),
    (["--tensor-parallel-size=2"], "unknown flag --tensor-parallel-size; did you mean --tensor-model-parallel-size?"),
    (["--frobnicate"], "unknown flag --frobnicate; pretrain_gpt.py --help lists every flag"),
    (["--seed", "1", "2"], "unexpected argument '2': a value without its flag"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
])
def test_bad_flags_are_one_line(extra, expected):
    with pytest.raises(ConfigError) as e:
        parse_args(TINY_GPT + extra, world_size=1)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("extra, expected", [
    (["--deepspeed_config", "{ds}", "--zero-stage", "3"],
     "--deepspeed_config {ds} without --deepspeed would be ignored and the run would train plain data-parallel; "
     "add --deepspeed"),
    (["--zero-stage", "3"], "--zero-stage 3 without --deepspeed would be ignored"),
    (["--use-distributed-optimizer", "--deepspeed", "--deepspeed_config", "{ds}", "--zero-stage", "0"],
     "--use-distributed-optimizer with ZeRO stage 0"),
])
def test_a_zero_config_without_deepspeed_is_refused(extra, expected, tmp_path):
    """Megatron-DeepSpeed ignores --deepspeed_config without --deepspeed and trains plain DDP; here that is an
    error (stage 0 without sharding is fine: --zero-stage 0 trains DDP)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    extra = [a.replace("{ds}", str(ds)) for a in extra]
    with pytest.raises(ConfigError, match="^" + re.escape(expected.replace("{ds}", str(ds)))):
        parse_args(TINY_GPT + extra, world_size=1)
    assert parse_args(TINY_GPT + ["--zero-stage", "0"], world_size=1).zero_cache is None


def test_help_shows_defaults():
    text = re.sub(r"\s+", " ", build_parser().format_help())
    for flag, default in (("--seed SEED", "1234"), ("--hidden-dropout HIDDEN_DROPOUT", "0.1"),
                          ("--lr-decay-style {constant,linear,cosine}", "linear"),
                          ("--log-interval LOG_INTERVAL", "100"),
                          ("--tensorboard-queue-size TENSORBOARD_QUEUE_SIZE", "1000")):
        assert re.search(re.escape(flag) + r" [^-]*\(default: " + re.escape(default) + r"\)", text), flag
    assert "--fp8-format" not in text  # refused flags stay out of --help (docs/megatron-compat.md lists them)


@pytest.mark.multiprocess
def test_an_unknown_flag_is_one_line_not_a_usage_dump():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY_GPT, "--lr-decay-iter", "5"], cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: unknown flag --lr-decay-iter; did you mean --lr-decay-iters? "
        "(docs/megatron-compat.md lists the Megatron-LM and Megatron-DeepSpeed flags this trainer takes)"]


@pytest.mark.multiprocess
def test_bad_flags_under_torchrun_exit_2_on_every_rank():
    """Rank 0 prints the one line; every rank leaves with exit code 2 (those torchrun stops too), none with a
    traceback of the trainer; torchrun's own failure report follows."""
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py", *TINY_GPT,
            "--num-experts", "6", "--expert-model-parallel-size", "4"]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "pretrain_gpt.py: error:" in ln]
    assert len(errors) == 1 and "--expert-model-parallel-size 4 must divide the data-parallel size 2" in errors[0], \
        proc.stderr
    assert "pretrain_gpt.py\", line" not in proc.stderr  # no traceback from the trainer's code
    codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", proc.stderr, re.M)  # torchrun's table: a row per rank
    assert codes == ["2", "2"], proc.stderr
