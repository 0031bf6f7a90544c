"""pretrain_gpt.py end to end: bad command lines fail with one clear line; fp16 / bf16 runs."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.common import make_dataset
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import TINY_GPT

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def _flag_value(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


@pytest.mark.parametrize("argv, env_world, expected", [
    (["--tensor-model-parallel-size", "3"], "4",
     "world size 4 is not divisible by tensor-parallel size 3 x pipeline-parallel size 1"),
    (["--global-batch-size", "7"], "1", "--global-batch-size 7 is not divisible by --micro-batch-size 2"),
    (["--pipeline-model-parallel-size", "3"], "3",
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    (["--fp16", "--bf16"], "1", "--fp16 and --bf16 are mutually exclusive"),
])
def test_bad_mesh_and_batch_give_one_clear_line(argv, env_world, expected):
    base = [a for a in TINY_GPT]
    if "--global-batch-size" in argv:
        base = _flag_value(base, "--global-batch-size", argv[1])
        argv = []
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *base, *argv], cwd=ROOT, capture_output=True,
                          text=True, env={"WORLD_SIZE": env_world, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert expected in lines[0]


def test_missing_required_flag_is_named():
    argv = TINY_GPT[:]
    i = argv.index("--hidden-size")
    del argv[i:i + 2]
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "the following arguments are required: --hidden-size" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_data_is_explained():
    argv = [a for a in TINY_GPT if a != "--mock-data"]
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--data-path" in proc.stderr and "Traceback" not in proc.stderr


def _train(rank, world, argv):
    from pretrain_gpt import main
    r = main(argv)
    return r.losses, r.skipped_iterations, r.loss_scales


@pytest.mark.parametrize("vocab", [120, 1000], ids=["padding-rows", "out-of-range"])
def test_data_from_another_tokenizer_is_one_line(tmp_path, vocab):
    """Token ids beyond the tokenizer's vocabulary (here 100 + eod) would train the padding rows (up to 128)
    or index past the embedding: either is refused with one line naming the data."""
    prefix = str(tmp_path / "other_tokenizer")
    make_dataset(prefix, [64] * 20, vocab=vocab)
    argv = [a for a in TINY_GPT if a != "--mock-data"] + ["--data-path", prefix]
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "outside this run's vocabulary of 101" in lines[0] and prefix in lines[0], lines[0]


def test_fp16_overflow_is_skipped_and_scale_recovers():
    # An absurd initial scale overflows fp16 gradients: those steps must be skipped and the scale lowered
    # until the gradients fit; after that the model trains.
    argv = _flag_value(TINY_GPT, "--train-iters", "16") + ["--fp16", "--initial-loss-scale", str(2.0 ** 24),
                                                           "--hysteresis", "1"]
    losses, skipped, scales = run_distributed(_train, 2, argv)[0]
    assert skipped and skipped[0] == 1, skipped
    assert all(scales[i] < scales[i - 1] for i in skipped if i > 1)
    assert scales[16] < 2.0 ** 24
    assert len(skipped) < 16 and skipped == list(range(1, len(skipped) + 1))  # overflow only at the start
    first_update = len(skipped) + 1
    assert losses[16] < losses[first_update]


def test_bf16_trains():
    argv = _flag_value(TINY_GPT, "--train-iters", "12") + ["--bf16"]
    losses, skipped, _ = run_distributed(_train, 1, argv)[0]
    assert not skipped
    assert losses[12] < losses[1] - 0.1


def test_bad_flags_under_torchrun_keep_their_one_line():
    """Every rank rejects the flags; the one that prints must not be stopped by torchrun before it does (the
    others leave after it). Three runs, as the race it guards against lost the line about one run in five."""
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py", *TINY_GPT,
            "--tensor-model-parallel-size", "3"]
    for _ in range(3):
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
        assert proc.returncode != 0
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
        assert len(errors) == 1 and "not divisible by tensor-parallel size 3" in errors[0], proc.stderr
