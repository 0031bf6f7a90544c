"""torchrun whose SIGTERM / SIGINT / SIGUSR1 let the workers save instead of killing them (preemption).

torchrun turns these signals into an exception: it sends SIGTERM to its workers, kills them after 30 s and
exits 1, whatever the workers did; SIGUSR1 (``sbatch --signal=USR1@...``) simply kills it. Here the first of
them is passed on to the workers (SIGUSR1 as SIGUSR1, the others as SIGTERM: ``pretrain_gpt.py
--exit-signal-handler`` then finishes its step, saves and exits 0) and torchrun keeps monitoring them, so it
exits 0 when they do. While they stop, a failed worker is not restarted (the job is going away); the agent
stops the rest as torchrun would. A repeat within ``SAME_REQUEST_S`` of the first signal is the same
preemption arriving by another path (Slurm and Kubernetes signal every process, the node agent passes it on);
a later one, or a signal before any worker runs, is torchrun's own: stop the workers now.

    python ptm_launch/graceful_torchrun.py <torchrun arguments>     # what ptm-launch runs on every node

Run by path, like node_agent.py: it imports nothing from this package.
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
from torch.distributed.elastic.agent.server import api as agent_api  # noqa: E402
from torch.distributed.elastic.multiprocessing import api as mp_api  # noqa: E402

SAME_REQUEST_S = 10.0  # as megatron/training/exit_conditions.py
GRACEFUL = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preemption:
    """The first graceful signal and when it came; installed in place of torchrun's handler."""

    def __init__(self, stop_now=mp_api._terminate_process_handler):
        self.signum: int | None = None
        self.first = 0.0
        self._stop_now = stop_now

    def handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is not None and now - self.first < SAME_REQUEST_S:
            return
        if self.signum is None and signum in GRACEFUL:
            # Recorded before anything slow: Python runs a copy that arrives meanwhile inside this call.
            self.signum, self.first = signum, now
            workers = psutil.Process().children()
            if workers:
                self._pass_on(signum, workers)
                return
        self._stop_now(signum, frame)  # raises torchrun's SignalException

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


def install(preemption: Preemption) -> None:
    """Route torchrun's signal handling through ``preemption`` and refuse restarts once it began."""
    mp_api._terminate_process_handler = preemption.handle  # torchrun installs it when it starts its workers
    signal.signal(signal.SIGUSR1, preemption.handle)  # torchrun leaves SIGUSR1 at its default: death
    restart = agent_api.SimpleElasticAgent._restart_workers

    def restart_unless_preempted(agent, worker_group):
        if preemption.signum is not None:
            raise mp_api.SignalException(f"workers failed while stopping for {signal.Signals(preemption.signum).name}",
                                         sigval=signal.Signals(preemption.signum))
        restart(agent, worker_group)

    agent_api.SimpleElasticAgent._restart_workers = restart_unless_preempted


if __name__ == "__main__":
    install(Preemption())
    torchrun.main()
