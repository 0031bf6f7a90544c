"""Slurm's environment inside an allocation -> the node pool: host names (hostlist syntax) and slots per node.

``ptm-launch --launcher slurm`` runs once in the batch script (or an salloc shell) and starts one srun step per
node, so the pool comes from what Slurm exported: ``SLURM_JOB_NODELIST`` (``node[01-03,07]``), ``SLURM_NNODES``,
the GPUs per node (``SLURM_GPUS_ON_NODE``, ``SLURM_GPUS_PER_NODE``) or the tasks per node
(``SLURM_NTASKS_PER_NODE``), and ``SLURM_JOB_ID`` as the rendezvous id.
"""
from __future__ import annotations

import re
from typing import Mapping

from ptm_launch.hostfile import HostfileError, check_host_name

_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")
_COUNT_RE = re.compile(r"(\d+)(?:\(x(\d+)\))?")


class SlurmEnvError(HostfileError):
    """Slurm variables that are missing or cannot be read (not inside an allocation, or a malformed list)."""


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1-2,4],b`` -> ``['a[1-2,4]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"hostlist {text!r}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmEnvError(f"hostlist {text!r}: '[' without ']'")
    parts.append(text[start:])
    return [p for p in (part.strip() for part in parts) if p]


def _expand_ranges(spec: str, text: str) -> list[str]:
    """``01-03,7`` -> ``['01', '02', '03', '7']``: each bound keeps its zero padding."""
    out = []
    for item in spec.split(","):
        match = _RANGE_RE.fullmatch(item.strip())
        if match is None:
            raise SlurmEnvError(f"hostlist {text!r}: {item!r} is not a number or a range like 01-04")
        first, last = match[1], match[2] or match[1]
        if int(last) < int(first):
            raise SlurmEnvError(f"hostlist {text!r}: range {item!r} runs backwards")
        width = len(first) if first.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``scontrol show hostnames``): ``gpu[01-02]-ib,login1`` in order."""
    hosts: list[str] = []
    for part in _split_top_level(text):
        names = [""]
        rest = part
        while rest:
            head, bracket, tail = rest.partition("[")
            names = [name + head for name in names]
            if not bracket:
                break
            spec, close, rest = tail.partition("]")
            names = [name + n for name in names for n in _expand_ranges(spec, text)]
        try:
            hosts.extend(check_host_name(name, f"SLURM_JOB_NODELIST {text!r}") for name in names)
        except HostfileError as e:
            raise SlurmEnvError(str(e)) from None
    if not hosts:
        raise SlurmEnvError(f"hostlist {text!r} names no hosts")
    return hosts


def expand_counts(text: str) -> list[int]:
    """Slurm's per-node counts: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for item in text.split(","):
        match = _COUNT_RE.fullmatch(item.strip())
        if match is None:
            raise SlurmEnvError(f"per-node count {text!r}: expected numbers like '8' or '2(x3),1'")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def _gpus_per_node(environ: Mapping[str, str]) -> int | None:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(key, "").strip()
        if value:
            count = value.rsplit(":", 1)[-1]  # --gpus-per-node=a100:4 -> 4
            if not count.isdigit():
                raise SlurmEnvError(f"{key}={value!r}: expected a GPU count like '8' or 'a100:8'")
            if int(count) > 0:
                return int(count)
    return None


def slurm_pool(environ: Mapping[str, str], num_gpus: int = -1) -> dict[str, int]:
    """{host: processes} for the allocation, hosts in ``SLURM_JOB_NODELIST`` order.

    Processes per node: ``--num_gpus`` if given, else the GPUs per node, else ``SLURM_NTASKS_PER_NODE`` (an
    allocation made with one task per GPU or per process), else 1.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError("--launcher slurm: SLURM_JOB_NODELIST is not set; run ptm-launch inside an allocation "
                            "(in an sbatch script, or in an salloc shell), e.g. examples/slurm/pretrain.sbatch")
    if environ.get("SLURM_STEP_ID") and int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        raise SlurmEnvError("--launcher slurm runs inside an srun step of several tasks; run ptm-launch once, in the "
                            "batch script itself: it starts one srun step per node")
    hosts = expand_hostlist(nodelist)
    nnodes = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
    if nnodes and int(nnodes) != len(hosts):
        raise SlurmEnvError(f"SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} host(s) but SLURM_NNODES={nnodes}")
    if num_gpus > 0:
        return dict.fromkeys(hosts, num_gpus)
    gpus = _gpus_per_node(environ)
    if gpus is not None:
        return dict.fromkeys(hosts, gpus)
    tasks = environ.get("SLURM_NTASKS_PER_NODE")
    if tasks:
        counts = expand_counts(tasks)
        counts = counts * len(hosts) if len(counts) == 1 else counts
        if len(counts) != len(hosts):
            raise SlurmEnvError(f"SLURM_NTASKS_PER_NODE={tasks!r} gives {len(counts)} count(s) for {len(hosts)} "
                                f"host(s)")
        return dict(zip(hosts, counts))
    return dict.fromkeys(hosts, 1)


def slurm_job_id(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
