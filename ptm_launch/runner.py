"""Entry point of ``ptm-launch``: hostfile -> selected hosts -> one torchrun per host -> job status."""
from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Mapping

from ptm_launch.commands import NodeSpec, plan_local, plan_remote
from ptm_launch.config import LaunchConfig, config_from_args
from ptm_launch.env import EnvFileError, env_file_values, forwarded_environ
from ptm_launch.hostfile import HostfileError, read_hostfile, select_resources
from ptm_launch.supervisor import Supervisor


def local_slot_count(cfg: LaunchConfig) -> int:
    """All local GPUs; on a machine without GPUs, --num_gpus CPU processes (default 1)."""
    import torch  # only needed without a hostfile; importing it takes a moment

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return cfg.num_gpus if cfg.num_gpus > 0 else 1


def plan(cfg: LaunchConfig, environ: Mapping[str, str], cwd: Path, home: Path, python: str) -> list[NodeSpec]:
    """The node processes to start; raises HostfileError / EnvFileError on bad input."""
    file_env = env_file_values(environ, cwd, home)
    pool = read_hostfile(cfg.hostfile) if cfg.hostfile else {"localhost": local_slot_count(cfg)}
    selection = select_resources(pool, cfg.include, cfg.exclude, cfg.num_nodes, cfg.num_gpus)
    if len(selection) == 1 and not cfg.force_multi:
        host, slots = next(iter(selection.items()))
        return plan_local(cfg, python, host, slots, pool[host], file_env)
    exports = {**forwarded_environ(environ), **file_env}
    return plan_remote(cfg, python, str(cwd), selection, pool, exports, dict(environ))


def describe(nodes: list[NodeSpec]) -> str:
    parts, first = [], 0
    for node in nodes:
        last = first + len(node.slots) - 1
        parts.append(f"{node.host} (node {node.node_rank}, ranks {first}-{last}, slots "
                     f"{','.join(map(str, node.slots))})")
        first = last + 1
    return f"{first} process(es) on {len(nodes)} node(s): " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(argv)
    try:
        nodes = plan(cfg, os.environ, Path.cwd(), Path.home(), sys.executable)
    except (HostfileError, EnvFileError) as exc:
        print(f"ptm-launch: error: {exc}", file=sys.stderr)
        return 2
    if len(nodes) > 1 or cfg.force_multi:
        if shutil.which(cfg.launcher) is None:
            package = {"ssh": "openssh-client", "pdsh": "pdsh"}[cfg.launcher]
            print(f"ptm-launch: error: {cfg.launcher} not found on PATH; install it (Debian/Ubuntu package "
                  f"{package})", file=sys.stderr)
            return 2
    elif cfg.hostfile:
        print(f"ptm-launch: one host selected: running on this machine without {cfg.launcher} "
              f"(--force_multi to go through {cfg.launcher})", file=sys.stderr)
    print(f"ptm-launch: {describe(nodes)}", file=sys.stderr, flush=True)
    supervisor = Supervisor(nodes, cfg.stop_timeout)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: supervisor.request_stop(signum))
    return supervisor.run()
