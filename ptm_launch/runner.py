"""Entry point of ``ptm-launch``: hostfile -> selected hosts -> one torchrun per host -> job status."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path
from typing import Mapping

from ptm_launch.checkpoints import CheckpointTracker
from ptm_launch.commands import NodeSpec, plan_local, plan_remote, plan_slurm
from ptm_launch.config import LAUNCHER_PACKAGES, LaunchConfig, config_from_args
from ptm_launch.env import EnvFileError, env_file_values, forwarded_environ
from ptm_launch.hostfile import HostfileError, read_hostfile, select_resources
from ptm_launch.restarts import Restarts
from ptm_launch.slurm import slurm_job_id, slurm_pool
from ptm_launch.supervisor import Supervisor


def local_slot_count(cfg: LaunchConfig) -> int:
    """All local GPUs; on a machine without GPUs, --num_gpus CPU processes (default 1)."""
    import torch  # only needed without a hostfile; importing it takes a moment

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return cfg.num_gpus if cfg.num_gpus > 0 else 1


def with_rdzv_id(cfg: LaunchConfig, environ: Mapping[str, str]) -> LaunchConfig:
    """The job's c10d rendezvous name: the Slurm job id inside an allocation, else a fresh one."""
    if cfg.max_restarts == 0 or cfg.rdzv_id:
        return cfg
    job = slurm_job_id(environ) if cfg.launcher == "slurm" else None
    return dataclasses.replace(cfg, rdzv_id=f"slurm-{job}" if job else f"ptm-{uuid.uuid4().hex[:12]}")


def _check_node_range(cfg: LaunchConfig, selection: dict[str, list[int]], source: str) -> None:
    if cfg.min_nodes is not None and not cfg.min_nodes <= len(selection) <= cfg.max_nodes:
        raise HostfileError(f"--nnodes {cfg.min_nodes}:{cfg.max_nodes}, but {len(selection)} host(s) are selected "
                            f"from {source}: select {cfg.min_nodes} to {cfg.max_nodes} hosts or change the range")


def plan(cfg: LaunchConfig, environ: Mapping[str, str], cwd: Path, home: Path, python: str,
         max_restarts: int | None = None) -> list[NodeSpec]:
    """The node processes to start (``max_restarts``: torchrun's budget, when nodes are started again);
    raises HostfileError / EnvFileError on bad input."""
    file_env = env_file_values(environ, cwd, home)
    if cfg.launcher == "slurm":
        pool = slurm_pool(environ, cfg.num_gpus)
        selection = select_resources(pool, cfg.include, cfg.exclude, cfg.num_nodes, -1)
        _check_node_range(cfg, selection, "the Slurm allocation")
        return plan_slurm(cfg, python, selection, pool, file_env, dict(environ), max_restarts)
    pool = read_hostfile(cfg.hostfile) if cfg.hostfile else {"localhost": local_slot_count(cfg)}
    selection = select_resources(pool, cfg.include, cfg.exclude, cfg.num_nodes, cfg.num_gpus)
    _check_node_range(cfg, selection, cfg.hostfile or "this machine")
    if len(selection) == 1 and not cfg.force_multi:
        host, slots = next(iter(selection.items()))
        return plan_local(cfg, python, host, slots, pool[host], file_env, dict(environ), max_restarts)
    exports = {**forwarded_environ(environ), **file_env}
    return plan_remote(cfg, python, str(cwd), selection, pool, exports, dict(environ), max_restarts)


def describe(nodes: list[NodeSpec]) -> str:
    parts, first = [], 0
    for node in nodes:
        last = first + len(node.slots) - 1
        parts.append(f"{node.host} (node {node.node_rank}, ranks {first}-{last}, slots "
                     f"{','.join(map(str, node.slots))})")
        first = last + 1
    return f"{first} process(es) on {len(nodes)} node(s): " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    cfg = with_rdzv_id(config_from_args(argv), os.environ)
    cwd, home = Path.cwd(), Path.home()
    try:
        nodes = plan(cfg, os.environ, cwd, home, sys.executable)
    except (HostfileError, EnvFileError) as exc:
        print(f"ptm-launch: error: {exc}", file=sys.stderr)
        return 2
    remote = cfg.launcher == "slurm" or len(nodes) > 1 or cfg.force_multi
    if remote:
        if shutil.which(cfg.launcher_command) is None:
            print(f"ptm-launch: error: {cfg.launcher_command} not found on PATH; install it (Debian/Ubuntu package "
                  f"{LAUNCHER_PACKAGES[cfg.launcher]})", file=sys.stderr)
            return 2
    elif cfg.hostfile:
        print(f"ptm-launch: one host selected: running on this machine without {cfg.launcher} "
              f"(--force_multi to go through {cfg.launcher})", file=sys.stderr)
    print(f"ptm-launch: {describe(nodes)}", file=sys.stderr, flush=True)
    checkpoints = CheckpointTracker.from_args(cfg.user_args, cwd)
    if cfg.max_restarts > 0:
        print(f"ptm-launch: up to {cfg.max_restarts} restart(s) of every rank; {checkpoints.resume_note()}",
              file=sys.stderr, flush=True)
    supervisor = Supervisor(nodes, cfg.stop_timeout, restarts=Restarts(cfg.max_restarts, checkpoints),
                            respawn=lambda left: plan(cfg, os.environ, cwd, home, sys.executable, left),
                            preempt_timeout=cfg.preempt_timeout, min_nodes=cfg.min_nodes,
                            rejoin_every=cfg.rejoin_interval)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # USR1: ``sbatch --signal=B:USR1@...``
        signal.signal(signum, lambda signum, _frame: supervisor.request_stop(signum))
    return supervisor.run()
