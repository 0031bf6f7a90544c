"""Slurm's environment -> the node pool: hostlist expansion (as scontrol show hostnames does it), slots per node."""
from __future__ import annotations

import pytest

from ptm_launch.slurm import SlurmEnvError, expand_counts, expand_hostlist, slurm_job_id, slurm_pool


@pytest.mark.parametrize("hostlist, hosts", [
    # what `scontrol show hostnames` (Slurm 22.05) prints for these
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("x[001-002],y", ["x001", "x002", "y"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("login1", ["login1"]),
    ("gpu[1,3],cpu[10-11]", ["gpu1", "gpu3", "cpu10", "cpu11"]),
])
def test_hostlist_expansion(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist, message", [
    ("node[01-03", "'\\[' without '\\]'"),
    ("node01]", "'\\]' without '\\['"),
    ("node[a-b]", "'a-b' is not a number or a range"),
    ("node[5-2]", "range '5-2' runs backwards"),
    ("bad;host", "is not a valid host name"),
    ("", "names no hosts"),
])
def test_malformed_hostlists_are_named(hostlist, message):
    with pytest.raises(SlurmEnvError, match=message):
        expand_hostlist(hostlist)


def test_per_node_counts():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("8") == [8]
    with pytest.raises(SlurmEnvError, match="expected numbers like"):
        expand_counts("two")


BASE = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "77"}


@pytest.mark.parametrize("extra, num_gpus, pool", [
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"}, -1, {"gpu01": 8, "gpu02": 8}),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, -1, {"gpu01": 4, "gpu02": 4}),
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_NTASKS_PER_NODE": "6"}, -1, {"gpu01": 6, "gpu02": 6}),
    ({"SLURM_NTASKS_PER_NODE": "1"}, -1, {"gpu01": 1, "gpu02": 1}),
    ({"SLURM_GPUS_ON_NODE": "8"}, 2, {"gpu01": 2, "gpu02": 2}),  # --num_gpus wins
    ({}, -1, {"gpu01": 1, "gpu02": 1}),
])
def test_slots_per_node(extra, num_gpus, pool):
    assert slurm_pool({**BASE, **extra}, num_gpus) == pool
    assert list(slurm_pool({**BASE, **extra}, num_gpus)) == ["gpu01", "gpu02"]  # SLURM_JOB_NODELIST order


@pytest.mark.parametrize("environ, message", [
    ({}, "SLURM_JOB_NODELIST is not set; run ptm-launch inside an allocation"),
    ({**BASE, "SLURM_NNODES": "3"}, "names 2 host\\(s\\) but SLURM_NNODES=3"),
    ({**BASE, "SLURM_GPUS_PER_NODE": "a100:many"}, "SLURM_GPUS_PER_NODE='a100:many': expected a GPU count"),
    ({**BASE, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}, "run ptm-launch once, in the batch script"),
])
def test_environment_problems_are_named(environ, message):
    with pytest.raises(SlurmEnvError, match=message):
        slurm_pool(environ)


def test_job_id():
    assert slurm_job_id(BASE) == "77" and slurm_job_id({"SLURM_JOBID": "5"}) == "5" and slurm_job_id({}) is None
