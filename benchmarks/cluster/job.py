"""One torchrun job on the emulated hosts: a torchrun per host inside its namespace, the rendezvous on the
first host, and the kernel's byte counters read at every step a log line reports: the trainer's (Megatron
prints it on the last rank, so every host's output is read) or the peer benchmark harness's
(benchmarks/peer_workers/harness.py, printed by rank 0)."""
from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.cluster import counters
from benchmarks.cluster.counters import LinkBytes
from benchmarks.cluster.hosts import REPO, ClusterSpec

# the trainer's log line (megatron/training/train_log.py) and the comm line under it (zero_cache comm stats)
ITERATION = re.compile(r"^\s*iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)")
COMM = re.compile(r"^\s*comm \(step (\d+), data-parallel group\) \|(.*)")
COLLECTIVE_MIB = re.compile(r"\w+: \d+ calls, ([0-9.]+) MiB")
# the peer harness's step line: "[system] step s/N: loss L, T s, ..." (the loss may print as nan or inf)
HARNESS_STEP = re.compile(r"^\[[^\]]+\] step (\d+)/\d+: loss ([-+0-9.eE]+|[-+]?nan|[-+]?inf), ([0-9.]+) s\b")
STOP_GRACE_S = 10.0


@dataclass
class Step:
    iteration: int
    seconds: float  # the step time the line reports (the trainer: its elapsed time per iteration)
    links: LinkBytes  # what the kernel counted since the previous step's line (the first: since the start)
    engine_bytes: int | None = None  # the logging rank's collectives of the step, by the engine's accounting
    loss: float | None = None  # the harness's line prints the global batch's mean loss; the trainer's: None


@dataclass
class JobResult:
    returncode: int
    failure: str | None
    output: list[str]  # every host's lines, as they came, each prefixed with its host's address
    steps: list[Step]
    total: LinkBytes  # the whole job, start-up included


@dataclass(frozen=True)
class Summary:
    """Medians over the steps after the warm-up ones (the first carries start-up traffic), per step."""
    steps: int
    seconds: float
    inter_bytes: float
    intra_bytes: float
    engine_bytes: float | None


def parse_step(line: str) -> Step | None:
    """A step's log line (the trainer's or the harness's) as a Step, its link bytes still to be filled in."""
    if m := ITERATION.match(line):
        return Step(int(m.group(1)), float(m.group(2)) / 1e3, LinkBytes(()))
    if m := HARNESS_STEP.match(line):
        return Step(int(m.group(1)), float(m.group(3)), LinkBytes(()), loss=float(m.group(2)))
    return None


def summarize(result: JobResult, skip: int = 1) -> Summary | None:
    """Medians over the steps after the first ``skip`` (warm-up: start-up traffic, first-step tracing)."""
    steps = result.steps[skip:] or result.steps
    if not steps:
        return None
    engine = [s.engine_bytes for s in steps if s.engine_bytes is not None]
    return Summary(len(steps), statistics.median(s.seconds for s in steps),
                   statistics.median(s.links.inter for s in steps), statistics.median(s.links.intra for s in steps),
                   statistics.median(engine) if engine else None)


def run_job(spec: ClusterSpec, argv: list[str], timeout_s: float, echo: Callable[[str], None] | None = None,
            port: int = 29500, python: str = sys.executable, stop_at: re.Pattern | None = None) -> JobResult:
    """Run ``argv`` (a script and its arguments, or ``-m module ...``) under ``python``'s torchrun on every
    host; ``echo`` gets the output lines as they come. ``stop_at``: the job is stopped (not failed) once a line
    matches it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "GLOO_SOCKET_IFNAME": "eth0"}  # the host's own address: peers on the host then go over its lo
    before = last = counters.read(spec.namespaces)
    procs: list[subprocess.Popen] = []
    for host in range(spec.hosts):
        cmd = ["ip", "netns", "exec", spec.namespace(host), python, "-m", "torch.distributed.run",
               "--nnodes", str(spec.hosts), "--node-rank", str(host), "--nproc-per-node", str(spec.ranks_per_host),
               "--master-addr", spec.address(0), "--master-port", str(port), *argv]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    output: list[str] = []
    by_host: list[list[str]] = [[] for _ in procs]
    steps: list[Step] = []
    lock = threading.Lock()
    stop = threading.Event()

    def read(host: int) -> None:
        nonlocal last
        for raw in procs[host].stdout:
            line = raw.rstrip("\n")
            with lock:
                by_host[host].append(line)
                output.append(f"{spec.address(host)}: {line}")
                if echo:
                    echo(output[-1])
                if stop_at is not None and stop_at.search(line):
                    stop.set()
                if step := parse_step(line):
                    now = counters.read(spec.namespaces)
                    step.links = now - last
                    steps.append(step)
                    last = now
                elif (m := COMM.match(line)) and steps and steps[-1].iteration == int(m.group(1)):
                    mib = sum(float(x) for x in COLLECTIVE_MIB.findall(m.group(2)))
                    steps[-1].engine_bytes = round(mib * 2**20)

    readers = [threading.Thread(target=read, args=(host,), daemon=True) for host in range(spec.hosts)]
    for reader in readers:
        reader.start()
    failure, code, bad = None, 0, None
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and not stop.is_set():
            bad = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if bad is not None:  # the first host to fail, before the others are stopped
                break
            if time.monotonic() > deadline:
                failure, code = f"the job ran past its {timeout_s:.0f} s limit", 124
                break
            time.sleep(0.2)
    finally:
        _stop(procs)
        for reader in readers:
            reader.join(timeout=30)
    if failure is None and bad is None and not stop.is_set():
        bad = next((i for i, p in enumerate(procs) if p.returncode), None)
    if failure is None and bad is not None:
        code = procs[bad].returncode
        failure = f"host {bad + 1} ({spec.address(bad)}) exited with code {code}{_tail(by_host[bad])}"
    return JobResult(code, failure, output, steps, counters.read(spec.namespaces) - before)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each torchrun's session (torchrun passes it to its ranks), SIGKILL after a grace period; then
    SIGKILL to what is left of the sessions (helpers such as multiprocessing's resource tracker ignore SIGTERM
    and would hold the output pipes open)."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for p in running:
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(lines: list[str]) -> str:
    return "; its last lines:\n  " + "\n  ".join(lines[-8:]) if lines else " and printed nothing"
