"""torchrun whose SIGTERM / SIGINT / SIGUSR1 let the workers save instead of killing them (preemption).

torchrun turns these signals into an exception: it sends SIGTERM to its workers, kills them after 30 s and
exits 1, whatever the workers did; SIGUSR1 (``sbatch --signal=USR1@...``) simply kills it. This runs torchrun
(``torch.distributed.run.main``) in this process with ``--signals-to-handle`` less these three, which it
handles itself: the first of them is passed on to the workers (SIGUSR1 as SIGUSR1, the others as SIGTERM:
``pretrain_gpt.py --exit-signal-handler`` then finishes its step, saves and exits 0) while torchrun keeps
monitoring them, so it exits 0 when they do. A repeat within ``SAME_REQUEST_S`` of the first signal is the
same preemption arriving by another path (Slurm and Kubernetes signal every process, the node agent passes it
on); a later one, or a signal before any worker runs, is torchrun's own: stop the workers now. A worker that
fails while they stop is not restarted (the job is going away): torchrun's agent publishes the workers' state
and the restarts left as metrics (``torch.distributed.elastic.metrics``) before it decides on a restart, and
where it would restart, the handler of those metrics here stops torchrun as its own signal handler would,
which stops the rest.

    python ptm_launch/graceful_torchrun.py <torchrun arguments>     # what ptm-launch runs on every node

Only torch's public interfaces are used (tests/launcher/test_graceful_torchrun.py checks it), so a torch
upgrade that changes torch's internals does not break it. Run by path, like node_agent.py: it imports nothing
from this package.
"""
from __future__ import annotations

import os
import signal
import sys
import time

# Run by path, this file's folder comes first on sys.path, where the package's modules (config.py, env.py ...)
# would hide any top-level module of the same name that torch imports.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import psutil  # noqa: E402
from torch.distributed import run as torchrun  # noqa: E402
from torch.distributed.elastic import metrics  # noqa: E402
from torch.distributed.elastic.multiprocessing import SignalException  # noqa: E402

SAME_REQUEST_S = 10.0  # as megatron/training/exit_conditions.py
GRACEFUL = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
TORCHELASTIC_METRICS = "torchelastic"  # the metric group torchrun's agent publishes to


class Preemption(metrics.MetricHandler):
    """The first graceful signal and when it came; also the handler of torchrun's metrics, among which its
    agent publishes the restarts left and the workers' state (``workers.<role>.<state>``) on every check."""

    def __init__(self):
        self.signum: int | None = None
        self.first = 0.0
        self.restarts_left = 0

    def handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is not None and now - self.first < SAME_REQUEST_S:
            return
        if self.signum is None:
            # Recorded before anything slow: Python runs a copy that arrives meanwhile inside this call.
            self.signum, self.first = signum, now
            workers = psutil.Process().children()
            if workers:
                self._pass_on(signum, workers)
                return
        # What torchrun's own handler does: its agent stops the workers and torchrun exits 1.
        raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum).name}",
                              sigval=signal.Signals(signum))

    def emit(self, metric_data: metrics.MetricData) -> None:
        name = metric_data.name
        if not name.startswith("workers."):
            return
        if name.endswith(".remaining_restarts"):  # published just before the state
            self.restarts_left = metric_data.value
        elif self.signum is not None and self.restarts_left > 0 and name.endswith((".failed", ".unhealthy")):
            # Raised where torchrun would restart the workers: its agent stops the rest instead.
            raise SignalException(f"workers failed while stopping for {signal.Signals(self.signum).name}",
                                  sigval=signal.Signals(self.signum))

    @staticmethod
    def _pass_on(signum: int, workers: list[psutil.Process]) -> None:
        passed = signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM
        for worker in workers:
            try:
                worker.send_signal(passed)
            except psutil.NoSuchProcess:
                pass
        # os.write: a handler must not re-enter a buffered stream the interrupted code may be writing to.
        os.write(2, f"torchrun: {signal.Signals(signum).name} received: passed to its {len(workers)} worker(s) as "
                    f"{passed.name}; waiting for them to save and exit\n".encode())


def torchrun_argv(argv: list[str]) -> list[str]:
    """``argv`` with torchrun's ``--signals-to-handle`` (the user's or its default) less GRACEFUL, placed
    right before the training script so that it wins over one given earlier."""
    args = torchrun.parse_args(argv)
    ours = {s.name for s in GRACEFUL}
    kept = ",".join(s.strip() for s in args.signals_to_handle.split(",") if s.strip() not in ours)
    script_at = len(argv) - len(args.training_script_args) - 1
    if argv[script_at - 1:script_at] == ["--"]:
        script_at -= 1
    return [*argv[:script_at], f"--signals-to-handle={kept}", *argv[script_at:]]


def main(argv: list[str]) -> None:
    preemption = Preemption()
    for signum in GRACEFUL:
        signal.signal(signum, preemption.handle)
    metrics.configure(preemption, TORCHELASTIC_METRICS)
    torchrun.main(torchrun_argv(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
