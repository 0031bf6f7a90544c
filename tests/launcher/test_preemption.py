"""Preemption under ptm-launch: one SIGTERM, wherever it lands and whenever, saves the step and exits 0.

Tries in a row on a 2-rank tiny GPT with data-loader workers, each resuming from the checkpoint the previous
one saved. Each try sends SIGTERM to one of: the launcher, torchrun, one rank, or every process group of the
job at once (as Slurm and Kubernetes do: launcher, agent, torchrun, ranks, forkservers, workers), at one of
these moments: during the first step, a forward, a save, an evaluation. Every try must exit 0 with the step
it stopped at saved, the next try must resume from it, and every loss must equal an uninterrupted run's.

Each try starts a job (about 15 s here), so the suite runs 8: every target at two moments and every moment
for two targets, paired by the seed. ``PTM_PREEMPT_TRIES=20`` runs every pairing once and 4 random ones;
``PTM_PREEMPT_SEED`` changes the pairing and the timing.
"""
from __future__ import annotations

import itertools
import os
import random
import re
import signal
import time

import psutil
import pytest

from tests.launcher.launch_utils import LiveLauncher, gpt_losses_by_iteration, run_launcher, tiny_gpt_args

pytestmark = pytest.mark.multiprocess

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
TRIES = int(os.environ.get("PTM_PREEMPT_TRIES", "8"))
TRAIN_ITERS = 1000  # never reached: every try is stopped by its signal (the schedule depends on it)
SAVE_INTERVAL, EVAL_INTERVAL = 4, 3
TARGETS = ("launcher", "torchrun", "rank", "every group")
MOMENTS = ("first step", "forward", "save", "evaluation")
_STOPPED_RE = re.compile(r"SIGTERM received: stopping at iteration (\d+) after saving it")


def _args(ckpt: str | None) -> list[str]:
    """The tiny GPT with a data-loader worker and evaluations; saving to and resuming from ``ckpt`` with the
    signal handler (None: the uninterrupted reference, whose batches are the same without a worker)."""
    args = tiny_gpt_args(TRAIN_ITERS)
    args[args.index("--num-workers") + 1] = "0" if ckpt is None else "1"
    args[args.index("--eval-iters") + 1] = "1"
    args += ["--eval-interval", str(EVAL_INTERVAL)]
    if ckpt is None:
        return args
    return args + ["--save", ckpt, "--load", ckpt, "--save-interval", str(SAVE_INTERVAL), "--exit-signal-handler"]


def _wait_for_iteration(live: LiveLauncher, after: int, every: int) -> int:
    """Index of the next log line of an iteration that is a multiple of ``every``."""
    line = re.compile(rf"iteration\s+(\d+)/\s*{TRAIN_ITERS} \|")
    while True:
        index = live.wait_for(line, timeout=120, after=after)
        if int(line.search(live.lines[index]).group(1)) % every == 0:
            return index
        after = index + 1


def _handles_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        caught = int(re.search(r"^SigCgt:\s*(\w+)", f.read(), re.M).group(1), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _wait_for_first_step(live: LiveLauncher) -> None:
    """Until every rank is in its first step: the logging rank printed '> model:', and every rank installed the
    handler it installs just before the loop (another rank can be a moment behind)."""
    live.wait_for("> model:", timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = live.workers()
        if len(ranks) == 2 and all(_handles_sigterm(pid) for pid in ranks.values()):
            return
        time.sleep(0.01)
    raise AssertionError(f"the ranks did not reach their first step:\n{live.output}")


def _wait_for_moment(live: LiveLauncher, moment: str, rng: random.Random) -> None:
    start = live.wait_for("> model:", timeout=120)  # printed just before the first step
    if moment == "first step":
        _wait_for_first_step(live)
        time.sleep(rng.uniform(0.0, 0.3))
    elif moment == "forward":
        _wait_for_iteration(live, start, 1)
        time.sleep(rng.uniform(0.0, 0.3))
    else:  # the save or the evaluation starts right after that iteration's log line
        _wait_for_iteration(live, start, SAVE_INTERVAL if moment == "save" else EVAL_INTERVAL)
        time.sleep(rng.uniform(0.0, 0.05))


def _pairings(rng: random.Random) -> list[tuple[str, str]]:
    """TRIES (target, moment) pairs in a random order. Fewer than every pairing: a Latin design, so each
    target meets TRIES/4 moments and each moment TRIES/4 targets; otherwise every pairing, then random ones."""
    if TRIES < len(TARGETS) * len(MOMENTS):
        targets, moments = rng.sample(TARGETS, len(TARGETS)), rng.sample(MOMENTS, len(MOMENTS))
        tries = [(targets[i], moments[(i + k) % len(MOMENTS)]) for k in range(-(-TRIES // len(TARGETS)))
                 for i in range(len(TARGETS))][:TRIES]
    else:
        tries = list(itertools.product(TARGETS, MOMENTS))
        tries += [rng.choice(tries) for _ in range(TRIES - len(tries))]
    rng.shuffle(tries)
    return tries


def _send(live: LiveLauncher, target: str, rng: random.Random) -> str:
    if target == "launcher":
        live.proc.send_signal(signal.SIGTERM)
        return "the launcher"
    if target == "torchrun":
        (torchrun,) = live.torchruns()
        torchrun.send_signal(signal.SIGTERM)
        return "torchrun"
    if target == "rank":
        rank, pid = rng.choice(sorted(live.workers().items()))
        os.kill(pid, signal.SIGTERM)
        return f"rank {rank}"
    groups = {os.getpgid(live.proc.pid)}
    for proc in psutil.Process(live.proc.pid).children(recursive=True):
        try:
            groups.add(os.getpgid(proc.pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return f"{len(groups)} process groups"


def test_one_sigterm_anywhere_at_any_moment_saves_and_exits_zero(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    rng = random.Random(int(os.environ.get("PTM_PREEMPT_SEED", "41")))
    losses: dict[int, str] = {}
    resumed_at = 0
    tries = _pairings(rng)
    for attempt, (target, moment) in enumerate(tries, 1):
        live = LiveLauncher("--num_gpus", "2", "pretrain_gpt.py", *_args(ckpt), env=CPU_ONLY)
        _wait_for_moment(live, moment, rng)
        whom = _send(live, target, rng)
        code = live.finish(timeout=120)
        out = live.output
        what = f"try {attempt}: SIGTERM to {whom} during {moment!r}"
        assert code == 0, f"{what}: exit code {code}\n{out}"
        assert "Traceback" not in out and "exited unexpectedly" not in out, f"{what}\n{out}"
        if resumed_at:
            assert f"starting at iteration {resumed_at}" in out, f"{what}: did not resume\n{out}"
        stopped = int(_STOPPED_RE.search(out).group(1))
        tracker = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()
        assert stopped > resumed_at and tracker == str(stopped), f"{what}: tracker {tracker}\n{out}"
        losses.update(gpt_losses_by_iteration(out))
        resumed_at = stopped
    # The last checkpoint loads and trains on; every loss equals an uninterrupted run's.
    until = ["--exit-interval", str(resumed_at + 1)]
    final = run_launcher("--num_gpus", "2", "pretrain_gpt.py", *_args(ckpt), *until, env=CPU_ONLY, timeout=180)
    assert final.returncode == 0 and f"starting at iteration {resumed_at}" in final.stdout, final.stdout
    losses.update(gpt_losses_by_iteration(final.stdout))
    reference = run_launcher("--num_gpus", "2", "pretrain_gpt.py", *_args(None), *until, env=CPU_ONLY, timeout=300)
    assert reference.returncode == 0, reference.stdout
    assert losses == gpt_losses_by_iteration(reference.stdout)
