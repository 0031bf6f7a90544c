"""Command line of ``ptm-launch`` (the DeepSpeed runner's option names) and the config built from it."""
from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500
LAUNCHER_PACKAGES = {"ssh": "openssh-client", "pdsh": "pdsh", "slurm": "slurm-client"}


@dataclass(frozen=True)
class LaunchConfig:
    user_script: str
    user_args: tuple[str, ...]
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "ssh"
    launcher_args: tuple[str, ...] = ()
    ssh_port: int | None = None
    module: bool = False
    no_python: bool = False
    force_multi: bool = False
    stop_timeout: float = 30.0
    preempt_timeout: float = 300.0
    max_restarts: int = 0
    min_nodes: int | None = None  # --nnodes MIN:MAX: the job goes on while MIN nodes remain; None: fixed size
    max_nodes: int | None = None
    rejoin_interval: float = 30.0  # seconds between tries of a host left behind
    rdzv_id: str = ""  # the job's name in torchrun's c10d rendezvous (set by the runner when restarts are on)

    @property
    def launcher_command(self) -> str:
        return "srun" if self.launcher == "slurm" else self.launcher


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ptm-launch",
        description="Start a torch.distributed job on this machine or on the hosts of a hostfile: one torchrun "
                    "per host (over ssh or pdsh), ranks laid out in hostfile order.",
        epilog="Hostfile lines: 'hostname slots=N'. See docs/multinode.md.")
    parser.add_argument("--hostfile", default=None,
                        help="hostfile of 'hostname slots=N' lines; without it the job runs on this machine only")
    parser.add_argument("--include", default="",
                        help="use only these hosts/slots, e.g. 'worker-0@worker-1:0,2'")
    parser.add_argument("--exclude", default="",
                        help="leave out these hosts/slots, e.g. 'worker-1:0'")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N selected hosts")
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                        help="processes per host (the first N selected slots); without a hostfile and without "
                             "GPUs: the number of CPU processes (default 1)")
    parser.add_argument("--master_addr", default=None,
                        help="address of the first host as the other hosts reach it (default: its hostfile name)")
    parser.add_argument("--master_port", type=int, default=None,
                        help=f"TCP port of the rendezvous store on the first host (default {DEFAULT_MASTER_PORT}; "
                             f"a free port for a one-machine run)")
    parser.add_argument("--launcher", choices=("ssh", "pdsh", "slurm"), default="ssh",
                        help="how to start torchrun on the hosts; slurm: inside an sbatch/salloc allocation, one "
                             "srun step per node of SLURM_JOB_NODELIST (no hostfile)")
    parser.add_argument("--launcher_args", default="",
                        help="extra arguments for ssh, pdsh or srun, e.g. --launcher_args=\"-F ~/.ssh/cluster_config\" "
                             "(a leading ~ of each argument is expanded)")
    parser.add_argument("--ssh_port", type=int, default=None, help="sshd port on the hosts")
    parser.add_argument("--module", action="store_true", help="the script is a python module name (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run the script as an executable, not with python")
    parser.add_argument("--force_multi", action="store_true",
                        help="use ssh/pdsh even when only one host is selected")
    parser.add_argument("--stop_timeout", type=float, default=30.0,
                        help="seconds the other nodes get to stop after a failure (or once --preempt_timeout ran "
                             "out) before they are killed")
    parser.add_argument("--preempt_timeout", type=float, default=300.0,
                        help="seconds the ranks get to finish their step, save and exit after the launcher (or a "
                             "node) gets SIGTERM / SIGINT, before they are stopped without a save (default 300; "
                             "docs/fault-tolerance.md#preemption)")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="restart every rank up to N times when a rank or a node fails (torchrun's elastic agent "
                             "and c10d rendezvous); the script resumes from its checkpoint (pretrain_gpt.py: --save "
                             "DIR --load DIR)")
    parser.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                        help="elastic range (torchrun's): a node lost for good (its host unreachable) leaves the job "
                             "and the others go on from the latest checkpoint while MIN nodes remain, with the same "
                             "global batch; needs --max_restarts (each loss is one). The selected hosts must number "
                             "MIN to MAX (docs/fault-tolerance.md#losing-a-node)")
    parser.add_argument("--rejoin_interval", type=float, default=30.0,
                        help="with --nnodes: seconds between tries of a host that was left behind; when it answers "
                             "again, its torchrun joins and the job grows back (default 30)")
    parser.add_argument("user_script", help="training script (or module with --module)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments of the training script")
    return parser


def config_from_args(argv: list[str] | None = None) -> LaunchConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("num_nodes", "num_gpus"):
        value = getattr(args, flag)
        if value == 0 or value < -1:
            parser.error(f"--{flag} must be a positive integer (or left out for all), got {value}")
    for flag in ("master_port", "ssh_port"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < 65536:
            parser.error(f"--{flag} must be a TCP port 1..65535, got {value}")
    if args.module and args.no_python:
        parser.error("--module and --no_python cannot be combined")
    for flag in ("stop_timeout", "preempt_timeout", "rejoin_interval"):
        value = getattr(args, flag)
        if not 0 < value < float("inf"):
            parser.error(f"--{flag} must be a positive number of seconds, got {value}")
    if args.max_restarts < 0:
        parser.error(f"--max_restarts must be 0 or more, got {args.max_restarts}")
    min_nodes, max_nodes = _node_range(parser, args.nnodes)
    if min_nodes is not None and args.max_restarts == 0:
        parser.error(f"--nnodes {args.nnodes} continues after a lost node by restarting every rank: give "
                     f"--max_restarts N (N >= 1, one per loss)")
    if args.launcher == "slurm" and args.hostfile:
        parser.error("--launcher slurm takes the nodes from the allocation (SLURM_JOB_NODELIST); leave out --hostfile")
    return LaunchConfig(
        user_script=args.user_script, user_args=tuple(args.user_args), hostfile=args.hostfile,
        include=args.include, exclude=args.exclude, num_nodes=args.num_nodes, num_gpus=args.num_gpus,
        master_addr=args.master_addr, master_port=args.master_port, launcher=args.launcher,
        launcher_args=tuple(os.path.expanduser(arg) for arg in shlex.split(args.launcher_args)),
        ssh_port=args.ssh_port, module=args.module,
        no_python=args.no_python, force_multi=args.force_multi, stop_timeout=args.stop_timeout,
        preempt_timeout=args.preempt_timeout, max_restarts=args.max_restarts, min_nodes=min_nodes,
        max_nodes=max_nodes, rejoin_interval=args.rejoin_interval)


def _node_range(parser: argparse.ArgumentParser, text: str | None) -> tuple[int | None, int | None]:
    """``MIN:MAX`` (or ``N``: exactly N) as two numbers; (None, None) when not given."""
    if text is None:
        return None, None
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low, high = 0, 0
    if not 1 <= low <= high:
        parser.error(f"--nnodes {text}: give MIN:MAX with 1 <= MIN <= MAX (e.g. 1:2), or N")
    return low, high
