"""Helpers for the launcher tests: run ptm-launch (optionally inside a network namespace), parse output."""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from ptm_launch.commands import TORCHRUN_PATH

REPO = Path(__file__).resolve().parents[2]
STANDIN = "tests/launcher/standin_train.py"
_STEP_RE = re.compile(r"step (\d+) loss (\S+)")


def is_torchrun(argv: list[str]) -> bool:
    """Whether ``argv`` is a torchrun that ptm-launch started (``python -u .../graceful_torchrun.py ...``)."""
    return argv[1:3] == ["-u", TORCHRUN_PATH]


def launcher_argv(*args: str, netns: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "ptm_launch", *args]
    return ["ip", "netns", "exec", netns, *argv] if netns else argv


def run_launcher(*args: str, netns: str | None = None, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    """Run to completion; stdout and stderr merged into .stdout."""
    return subprocess.run(launcher_argv(*args, netns=netns), cwd=REPO, env={**os.environ, **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


class LiveLauncher:
    """A launcher running in the background whose output is collected line by line."""

    def __init__(self, *args: str, netns: str | None = None, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(launcher_argv(*args, netns=netns), cwd=REPO, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() when each line arrived
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self.times.append(time.monotonic())
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for(self, text: str, timeout: float, after: int = 0) -> int:
        """Index of the first line from ``after`` on that contains ``text`` (regex when it is a Pattern)."""
        def found() -> int | None:
            for i in range(after, len(self.lines)):
                line = self.lines[i]
                if (text.search(line) if isinstance(text, re.Pattern) else text in line):
                    return i
            return None
        with self._seen:
            self._seen.wait_for(lambda: found() is not None or not self._reader.is_alive(), timeout=timeout)
            index = found()
            assert index is not None, f"{text!r} did not appear within {timeout}s; output:\n{self.output}"
            return index

    def _processes(self) -> list[tuple[psutil.Process, dict[str, str], list[str], int]]:
        """(process, environment, argv, parent pid) of each process under this launcher (on this machine); one
        that exits while listed is left out."""
        found = []
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                found.append((proc, proc.environ(), proc.cmdline(), proc.ppid()))
            except psutil.Error:
                continue
        return found

    def workers(self) -> dict[int, int]:
        """{global rank: pid} of the training processes under this launcher (on this machine): torchrun's
        children (their data-loader workers and forkservers have the same RANK)."""
        found = self._processes()
        torchruns = {proc.pid for proc, _, argv, _ in found if is_torchrun(argv)}
        return {int(env["RANK"]): proc.pid for proc, env, _, parent in found if "RANK" in env and parent in torchruns}

    def torchruns(self) -> list[psutil.Process]:
        """The torchrun processes under this launcher (on this machine)."""
        return [proc for proc, _, argv, _ in self._processes() if is_torchrun(argv)]

    def finish(self, timeout: float) -> int:
        """Wait for the launcher to exit; fail (and kill it) if it takes longer than ``timeout``."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launcher still running {timeout}s later; output:\n{self.output}") from None
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        with self._seen:
            return "".join(self.lines)


def standin_report(output: str) -> dict:
    """What rank 0 of standin_train.py printed: all-reduce sum, per-rank placement, tag, losses."""
    def value(key: str) -> str:
        match = re.search(rf"{key}: (.*)", output)
        assert match, f"no '{key}:' line in output:\n{output}"
        return match.group(1)
    return {"allreduce": float(value("allreduce").split()[0]), "ranks": json.loads(value("ranks")),
            "tag": json.loads(value("tag")),
            "losses": [float(loss) for _, loss in sorted((int(s), v) for s, v in _STEP_RE.findall(output))]}


_GPT_ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")


def gpt_losses_by_iteration(lines: list[str] | str) -> dict[int, str]:
    """{iteration: lm loss as printed}; an iteration trained again after a restart keeps its last value."""
    lines = lines.splitlines() if isinstance(lines, str) else lines
    return {int(m[1]): m[2] for m in map(_GPT_ITERATION_RE.search, lines) if m}


def tiny_gpt_args(iters: int = 12) -> list[str]:
    """pretrain_gpt.py flags of the training tests' tiny GPT (mock data, DP over the ranks), logging every
    iteration, with dropout on so that a resumed run must restore the RNG states too."""
    from tests.training.parallel_harness import TINY_GPT

    args = list(TINY_GPT)
    for flag, value in (("--train-iters", str(iters)), ("--log-interval", "1"), ("--hidden-dropout", "0.1")):
        args[args.index(flag) + 1] = value
    return args


@functools.cache
def tiny_gpt_losses() -> dict[int, str]:
    """{iteration: loss} of tiny_gpt_args() trained uninterrupted by ptm-launch on 2 CPU ranks (computed once
    per test session: the restart tests compare against it)."""
    result = run_launcher("--num_gpus", "2", "pretrain_gpt.py", *tiny_gpt_args(), env={"CUDA_VISIBLE_DEVICES": ""},
                          timeout=300)
    assert result.returncode == 0, result.stdout
    losses = gpt_losses_by_iteration(result.stdout)
    assert sorted(losses) == list(range(1, 13))
    return losses
