"""Megatron's pretraining sampler and the data loader built on it (exact resume from consumed samples)."""
from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import threading
from typing import Iterator

import torch

# Signals the trainer's main process handles (megatron/training/exit_conditions.py, Ctrl-C). Slurm and Kubernetes
# send them to every process of the job: a worker or its forkserver dying of one breaks the loader (a worker's
# watchdog ends it once its forkserver is gone) just when the preempted trainer must finish its step and save.
_MAIN_PROCESS_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}
# A worker must still obey its own trainer's SIGTERM, which needs the sender's pid (Linux; elsewhere workers keep
# the default dispositions).
_DEAF_WORKERS = hasattr(signal, "sigwaitinfo")
# What the data loader's forkserver imports once, before any worker forks from it: without it every worker
# imports torch and the datasets itself (seconds each), and the first step of a run waits for all of them.
_WORKER_PRELOAD = ["torch", "megatron.data.gpt_dataset", "megatron.data.blendable_dataset",
                   "megatron.data.mock_dataset"]


class MegatronPretrainingSampler:
    """Batches of sample indices for one data-parallel rank, in Megatron's global order.

    Samples are read consecutively from ``consumed_samples``; each global slice of
    micro_batch_size * data_parallel_size samples is cut into one micro-batch per rank, in rank order.
    Starting at a checkpoint's consumed-samples count therefore resumes exactly where training stopped.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: the dataset has {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} must be in [0, {total_samples}): the dataset "
                             f"is exhausted; build it for more samples (more --train-iters or a larger blend)")
        if micro_batch_size <= 0 or data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"need micro_batch_size > 0 and 0 <= data_parallel_rank < data_parallel_size, got "
                             f"{micro_batch_size}, {data_parallel_rank}, {data_parallel_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_slice = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, partial = divmod(remaining, self.global_slice)
        return full + (1 if partial and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.global_slice):
            batch = list(range(start, min(start + self.global_slice, self.total_samples)))
            if len(batch) < self.global_slice and self.drop_last:
                return
            yield batch[first:first + self.micro_batch_size]


def build_pretraining_data_loader(dataset: torch.utils.data.Dataset | None, consumed_samples: int,
                                  micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int) -> torch.utils.data.DataLoader | None:
    """A DataLoader whose batches are ``{"text": LongTensor[micro_batch_size, seq_length + 1]}``."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    # Its own generator: starting an iterator draws a worker seed, which must not advance the global
    # RNG (dropout) stream, or a resumed run would diverge from the uninterrupted one.
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       generator=torch.Generator().manual_seed(consumed_samples),
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0,
                                       multiprocessing_context=_worker_context() if num_workers > 0 else None,
                                       worker_init_fn=functools.partial(_obey_only_the_trainer, os.getpid())
                                       if _DEAF_WORKERS else None)


def _worker_context():
    """Workers come from a forkserver, not fork: a forked worker keeps every page the trainer holds at fork
    time, so each page the trainer writes afterwards (gradient shards, gigabytes at scale) is duplicated.
    The server imports torch and the datasets once (a preload takes effect only before it starts)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_WORKER_PRELOAD)
    if _DEAF_WORKERS:
        _start_forkserver_deaf()
    return ctx


def _obey_only_the_trainer(trainer: int, _worker_id: int) -> None:
    """In a worker, whose trainer's signals are blocked: a SIGTERM the trainer itself sends still ends it
    (multiprocessing stops its daemon children that way when the trainer exits, and waits for them)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_PROCESS_SIGNALS)  # also where the forkserver predates us

    def wait_for_the_trainer() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != trainer:
            pass
        os._exit(0)

    threading.Thread(target=wait_for_the_trainer, name="sigterm_from_the_trainer", daemon=True).start()


def _start_forkserver_deaf() -> None:
    """Start the forkserver with the main process's signals blocked: the mask is inherited through its fork and
    exec and by every worker it forks, so none of them ever gets one. Here they stay pending for the handlers.
    The resource tracker the forkserver needs is started the same way; it ignores SIGINT and SIGTERM itself and
    unblocks them on its way out, so they are blocked again before the forkserver starts."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_PROCESS_SIGNALS)
    try:
        multiprocessing.resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_PROCESS_SIGNALS)
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
