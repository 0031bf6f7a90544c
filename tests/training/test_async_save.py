"""--async-save under kill -9, and damaged checkpoints of the plain trainer, end to end in subprocesses."""
from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

from tests.training.parallel_harness import TINY_GPT
from tests.training.run_trainer import losses, run, start

pytestmark = pytest.mark.multiprocess

ITERS = 30
LOG_EVERY_STEP = ["--log-interval", "1", "--train-iters", str(ITERS)]


def _argv(ckpt: str) -> list[str]:
    argv = [a for a in TINY_GPT if a not in ("--train-iters", "10", "--log-interval", "5")]
    return argv + LOG_EVERY_STEP + ["--save", ckpt, "--load", ckpt, "--save-interval", "1", "--async-save"]


def _complete(ckpt: str) -> int:
    """The tracker's iteration; its directory must be a complete checkpoint."""
    iteration = int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read())
    assert os.path.isfile(os.path.join(ckpt, f"iter_{iteration:07d}", "checksums.json"))
    return iteration


def test_kill_during_async_saves_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    code, out = run([a for a in TINY_GPT if a not in ("--train-iters", "10", "--log-interval", "5")]
                    + LOG_EVERY_STEP)
    assert code == 0, out
    reference = losses(out)
    assert sorted(reference) == list(range(1, ITERS + 1))
    rng = random.Random(0)
    seen: dict[int, float] = {}
    kills = 0
    while kills < 3:
        proc = start(_argv(ckpt))
        lines = []
        for line in proc.stdout:  # kill at a random moment after this attempt's first save was issued
            lines.append(line)
            if "saved checkpoint" in line or "written in" in line:
                break
        else:
            break  # training finished before a save was seen: nothing left to interrupt
        time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:
            lines += proc.stdout.readlines()
            seen.update(losses("".join(lines)))
            break
        os.kill(proc.pid, signal.SIGKILL)
        lines += proc.stdout.readlines()
        proc.wait()
        kills += 1
        seen.update(losses("".join(lines)))
        _complete(ckpt)  # the previous complete checkpoint stays loadable
    code, out = run(_argv(ckpt))
    assert code == 0, out
    seen.update(losses(out))
    assert kills == 3
    resumed = [int(m) for m in re.findall(r"resuming at iteration (\d+)", out)]
    assert resumed and 0 < resumed[0] < ITERS
    for it, loss in seen.items():  # every iteration any attempt ran printed the uninterrupted run's loss
        assert loss == pytest.approx(reference[it], rel=1e-6), f"iteration {it}"
    assert max(seen) == ITERS and _complete(ckpt) == ITERS
    blocked = [float(b) for b in re.findall(r"training blocked ([0-9.]+) s", out)]
    assert blocked, out
    # What crashed saves left (incomplete directories, temporary files) did not survive the later saves.
    for name in os.listdir(ckpt):
        assert not re.search(r"\.tmp\.\d+$", name), name
        path = os.path.join(ckpt, name)
        if os.path.isdir(path) and name != "logs":  # logs/: the trainer's text log, not a checkpoint
            assert os.path.isfile(os.path.join(path, "checksums.json")), f"{path} is incomplete"


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_flipped_bytes_in_a_saved_checkpoint_stop_the_resume_with_one_line(tmp_path, ckpt_format):
    ckpt = str(tmp_path / "ckpt")
    base = [a for a in TINY_GPT if a not in ("--train-iters", "10")]
    code, out = run(base + ["--train-iters", "3", "--save", ckpt, "--ckpt-format", ckpt_format])
    assert code == 0, out
    it_dir = os.path.join(ckpt, "iter_0000003")
    if ckpt_format == "torch":
        target = os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt")
    else:
        target = os.path.join(it_dir, next(f for f in os.listdir(it_dir) if f.endswith(".distcp")))
    raw = bytearray(open(target, "rb").read())
    at = len(raw) // 2
    raw[at:at + 16] = bytes(b ^ 0xFF for b in raw[at:at + 16])  # 16 bytes inside the tensor data
    open(target, "wb").write(bytes(raw))
    code, out = run(base + ["--train-iters", "5", "--load", ckpt])
    assert code == 2, out
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert target in errors[0] and "corrupted" in errors[0] and "load an earlier iteration" in errors[0]
    assert "iteration        4" not in out  # nothing trained on the damaged weights


@pytest.mark.parametrize("damage", ["no-checksums", "metadata"])
def test_damage_to_the_tracked_checkpoint_is_one_line_and_deletes_nothing(tmp_path, damage):
    """The checkpoint the tracker names lost its checksums file, or its DCP metadata was overwritten: the resume
    stops with one line naming the file, and the directory (the run's only copy) is left as it is."""
    ckpt = str(tmp_path / "ckpt")
    base = [a for a in TINY_GPT if a not in ("--train-iters", "10")]
    code, out = run(base + ["--train-iters", "3", "--save", ckpt])
    assert code == 0, out
    it_dir = os.path.join(ckpt, "iter_0000003")
    if damage == "no-checksums":
        target = os.path.join(it_dir, "checksums.json")
        os.remove(target)
    else:
        target = os.path.join(it_dir, ".metadata")
        raw = open(target, "rb").read()
        open(target, "wb").write(b"garbage\n" + raw[8:])  # same size: only the checksum can tell
    files = sorted(os.listdir(it_dir))
    code, out = run(base + ["--train-iters", "5", "--load", ckpt])
    assert code == 2, out
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert target in errors[0] and ("incomplete" if damage == "no-checksums" else "corrupted") in errors[0], out
    assert sorted(os.listdir(it_dir)) == files


@pytest.mark.parametrize("flag", ["--save", "--load"])
def test_a_file_as_the_checkpoint_directory_stops_before_training(tmp_path, flag):
    """--save into a path that cannot hold a directory stops at start-up, not at the first save after
    training; --load of a file is a mistake, not "no checkpoint there"."""
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    base = [a for a in TINY_GPT if a not in ("--train-iters", "10")]
    code, out = run(base + ["--train-iters", "3", flag, str(path), "--save-interval", "2"])
    assert code == 2, out
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert f"{flag} {path}" in errors[0], out
