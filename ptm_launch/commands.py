"""Command lines: torchrun per node, wrapped in the node agent, sent over ssh/pdsh or run locally.

Everything sent to a remote shell is built from a list of arguments, each ``shlex.quote``-d, so a
host name, a script argument or an environment value cannot run commands on the remote host.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ptm_launch import node_agent
from ptm_launch.config import DEFAULT_MASTER_PORT, LaunchConfig

# ssh must fail instead of prompting, give up on a host that does not answer, and notice a host that went
# silent (power loss, network).
SSH_DEFAULT_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=10", "-o",
                       "ServerAliveCountMax=3")
AGENT_PATH = str(Path(node_agent.__file__).resolve())
# torchrun with preemption that lets the workers save (graceful_torchrun.py); by path: importing it imports torch.
TORCHRUN_PATH = str(Path(__file__).resolve().with_name("graceful_torchrun.py"))


@dataclass(frozen=True)
class NodeSpec:
    host: str
    node_rank: int
    slots: tuple[int, ...]
    argv: tuple[str, ...]  # executed on this machine: ssh/pdsh, or the agent itself for a local run
    env: dict[str, str] = field(default_factory=dict)  # set on top of the launcher's environment
    output_prefix: str = ""  # put before every output line (pdsh adds its own "host: ")
    stdin_reaches_agent: bool = True  # closing our stdin pipe stops the node (not through pdsh)


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    master_addr: str | None  # None: torchrun --standalone picks a free local port
    master_port: int | None
    elastic: bool = False  # c10d rendezvous: torchrun's agents can restart every rank together
    min_nodes: int | None = None  # elastic range: a round forms with this many nodes and up to ``nnodes``


# torch 2.13's agents share their rendezvous store with the workers and keep it across restarts, so restarted
# workers read the previous attempt's addresses and hang or fail to connect; a store per attempt avoids it.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# The agents' INFO lines carry the events the launcher reports (a worker failed, restart, new round, ranks);
# it keeps them out of the output (node_output.py).
AGENT_LOG_ENV = {"LOGLEVEL": "INFO"}


def torchrun_argv(cfg: LaunchConfig, python: str, rdzv: Rendezvous, node_rank: int, nproc: int,
                  local_addr: str | None = None, max_restarts: int | None = None) -> list[str]:
    """One node's torchrun. Elastic: c10d rendezvous, node 0 hosts its store, ``local_addr`` is how the others
    reach this node (and orders the nodes: the rendezvous ranks them by it)."""
    nnodes = f"{rdzv.min_nodes}:{rdzv.nnodes}" if rdzv.min_nodes is not None else str(rdzv.nnodes)
    argv = [python, "-u", TORCHRUN_PATH, "--nnodes", nnodes,
            "--nproc-per-node", str(nproc)]
    if rdzv.master_addr is None:
        argv.append("--standalone")
    elif rdzv.elastic:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rdzv.master_addr}:{rdzv.master_port}",
                 "--rdzv-id", cfg.rdzv_id]
        if local_addr is not None:
            argv += ["--rdzv-conf", f"is_host={int(node_rank == 0)}", "--local-addr", local_addr]
    else:
        argv += ["--node-rank", str(node_rank), "--master-addr", rdzv.master_addr,
                 "--master-port", str(rdzv.master_port)]
    if rdzv.elastic:
        argv += ["--max-restarts", str(cfg.max_restarts if max_restarts is None else max_restarts)]
    if cfg.module:
        argv.append("--module")
    if cfg.no_python:
        argv.append("--no-python")
    return argv + [cfg.user_script, *cfg.user_args]


def agent_argv(cfg: LaunchConfig, python: str, command: list[str], watch_stdin: bool, label: str) -> list[str]:
    """The node agent around ``command``: it gives the ranks half the launcher's --stop_timeout to stop after a
    failure, and all of --preempt_timeout to save and stop when the job is preempted."""
    flags = ["--watch-stdin"] if watch_stdin else []
    return [python, "-u", AGENT_PATH, *flags, "--grace", str(cfg.stop_timeout / 2), "--preempt-grace",
            str(cfg.preempt_timeout), "--label", label, "--", *command]


def remote_shell_command(cwd: str, exports: dict[str, str], argv: list[str]) -> str:
    """``cd CWD && exec env K=V ... ARGV``: one POSIX shell line, every piece quoted."""
    words = ["env", *(f"{key}={value}" for key, value in exports.items()), *argv]
    return f"cd {shlex.quote(cwd)} && exec " + " ".join(shlex.quote(word) for word in words)


def ssh_argv(cfg: LaunchConfig, host: str, command: str) -> list[str]:
    port = ["-p", str(cfg.ssh_port)] if cfg.ssh_port else []
    # ssh keeps the first value of an option: the user's --launcher_args override our defaults.
    return ["ssh", *cfg.launcher_args, *port, *SSH_DEFAULT_OPTIONS, "--", host, command]


def pdsh_argv(cfg: LaunchConfig, host: str, command: str) -> list[str]:
    return ["pdsh", "-S", *cfg.launcher_args, "-w", host, command]


def pdsh_env(cfg: LaunchConfig, environ: dict[str, str]) -> dict[str, str]:
    port = f" -p {cfg.ssh_port}" if cfg.ssh_port else ""
    append = f"{environ.get('PDSH_SSH_ARGS_APPEND', '')}{port} {' '.join(SSH_DEFAULT_OPTIONS)}".strip()
    return {"PDSH_RCMD_TYPE": environ.get("PDSH_RCMD_TYPE", "ssh"), "PDSH_SSH_ARGS_APPEND": append}


def visible_devices(slots: list[int], total: int) -> dict[str, str]:
    """Pin a node to its selected slots only when they are not simply all of them."""
    return {} if slots == list(range(total)) else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}


def torchrun_env(cfg: LaunchConfig, environ: dict[str, str]) -> dict[str, str]:
    """Variables every node's torchrun gets from the launcher (the user's own LOGLEVEL wins)."""
    env = {} if "LOGLEVEL" in environ else dict(AGENT_LOG_ENV)
    return {**env, **(ELASTIC_ENV if cfg.max_restarts > 0 else {})}


def elastic_order(cfg: LaunchConfig, hosts: list[str]) -> list[str]:
    """Node order of the job. The c10d rendezvous ranks nodes by their address (``--local-addr``, the host's
    name here), so with restarts the nodes are laid out in that order, the first one hosting the store."""
    return sorted(hosts) if cfg.max_restarts > 0 else hosts


def plan_local(cfg: LaunchConfig, python: str, host: str, slots: list[int], total: int,
               file_env: dict[str, str], environ: dict[str, str], max_restarts: int | None = None) -> list[NodeSpec]:
    """One node on this machine: torchrun under the agent, no ssh."""
    explicit = cfg.master_port is not None or cfg.master_addr is not None
    elastic = cfg.max_restarts > 0
    rdzv = Rendezvous(1, cfg.master_addr or "127.0.0.1", cfg.master_port or DEFAULT_MASTER_PORT, elastic) \
        if explicit else Rendezvous(1, None, None, elastic)
    command = torchrun_argv(cfg, python, rdzv, 0, len(slots), max_restarts=max_restarts)
    argv = agent_argv(cfg, python, command, watch_stdin=True, label=host)
    env = {**file_env, **visible_devices(slots, total), **torchrun_env(cfg, environ)}
    return [NodeSpec(host, 0, tuple(slots), tuple(argv), env)]


def _node_agents(cfg: LaunchConfig, python: str, selection: dict[str, list[int]], max_restarts: int | None,
                 watch_stdin: bool):
    """(node rank, host, slots, the agent's argv around the node's torchrun) of a multi-node job: one
    rendezvous on the first host (in ``elastic_order``) unless --master_addr/--master_port say otherwise."""
    hosts = elastic_order(cfg, list(selection))
    rdzv = Rendezvous(len(hosts), cfg.master_addr or hosts[0], cfg.master_port or DEFAULT_MASTER_PORT,
                      cfg.max_restarts > 0, cfg.min_nodes)
    for node_rank, host in enumerate(hosts):
        slots = selection[host]
        command = torchrun_argv(cfg, python, rdzv, node_rank, len(slots), local_addr=host, max_restarts=max_restarts)
        yield node_rank, host, slots, agent_argv(cfg, python, command, watch_stdin=watch_stdin, label=host)


def plan_remote(cfg: LaunchConfig, python: str, cwd: str, selection: dict[str, list[int]],
                pool: dict[str, int], exports: dict[str, str], environ: dict[str, str],
                max_restarts: int | None = None) -> list[NodeSpec]:
    """One ssh/pdsh process per selected host; node ranks (and so global ranks) in hostfile order (in host-name
    order with restarts, see ``elastic_order``)."""
    exports = {**exports, **torchrun_env(cfg, environ)}
    ssh = cfg.launcher == "ssh"  # pdsh does not pass our stdin on, so the agent cannot watch it
    nodes = []
    for node_rank, host, slots, argv in _node_agents(cfg, python, selection, max_restarts, watch_stdin=ssh):
        shell = remote_shell_command(cwd, {**exports, **visible_devices(slots, pool[host])}, argv)
        if ssh:
            nodes.append(NodeSpec(host, node_rank, tuple(slots), tuple(ssh_argv(cfg, host, shell)),
                                  output_prefix=f"{host}: "))
        else:
            nodes.append(NodeSpec(host, node_rank, tuple(slots), tuple(pdsh_argv(cfg, host, shell)),
                                  env=pdsh_env(cfg, environ), stdin_reaches_agent=False))
    return nodes


def srun_argv(cfg: LaunchConfig, host: str, command: list[str]) -> list[str]:
    """One step of one task on ``host`` of the allocation; srun passes our environment and directory on."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", f"--job-name=ptm-node-{host}",
            "--kill-on-bad-exit=1", *cfg.launcher_args, *command]


def plan_slurm(cfg: LaunchConfig, python: str, selection: dict[str, list[int]], pool: dict[str, int],
               file_env: dict[str, str], environ: dict[str, str], max_restarts: int | None = None) -> list[NodeSpec]:
    """Inside an allocation: one srun step per selected node, each running the agent and that node's torchrun."""
    env = {**file_env, **torchrun_env(cfg, environ)}
    nodes = []
    for node_rank, host, slots, argv in _node_agents(cfg, python, selection, max_restarts, watch_stdin=True):
        nodes.append(NodeSpec(host, node_rank, tuple(slots), tuple(srun_argv(cfg, host, argv)),
                              env={**env, **visible_devices(slots, pool[host])}, output_prefix=f"{host}: "))
    return nodes
