"""Hostfile parsing and DeepSpeed-style host/slot selection (fast, no processes)."""
from __future__ import annotations

import re

import pytest

from ptm_launch.hostfile import HostfileError, parse_hostfile_text, read_hostfile, select_resources

POOL_TEXT = """
# cluster
worker-0 slots=4
worker-1   slots = 4   # trailing comment
10.0.0.7 slots=2
"""


def test_parse_keeps_order_and_slots():
    pool = parse_hostfile_text(POOL_TEXT)
    assert list(pool.items()) == [("worker-0", 4), ("worker-1", 4), ("10.0.0.7", 2)]


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\nworker-0 slots=2\n", "line 2: duplicate host 'worker-0'"),
    ("worker-0 4\n", "line 1: malformed line 'worker-0 4'"),
    ("worker-0 slots=4 extra\n", "line 1: malformed line"),
    ("worker-0 slots=0\n", "line 1: slots must be a positive integer, got '0'"),
    ("worker-0 slots=two\n", "slots must be a positive integer, got 'two'"),
    ("\n# only comments\n", "no hosts found"),
    ("w;touch${IFS}x slots=1\n", "is not a valid host name"),
    ("-oProxyCommand=x slots=1\n", "is not a valid host name"),
    ("$(reboot) slots=1\n", "is not a valid host name"),
])
def test_parse_errors_name_the_line(text, message):
    with pytest.raises(HostfileError, match=re.escape(message)):
        parse_hostfile_text(text, source="hf")


def test_missing_hostfile_says_how_to_fix(tmp_path):
    with pytest.raises(HostfileError, match="not found; pass an existing file to --hostfile"):
        read_hostfile(tmp_path / "nope")


def test_directory_as_hostfile_says_so(tmp_path):
    with pytest.raises(HostfileError, match="is a directory; pass an existing file to --hostfile"):
        read_hostfile(tmp_path)


def test_hostfile_that_is_not_text_is_one_error(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"\xff\xfe garbage\n")
    with pytest.raises(HostfileError, match="is not UTF-8 text"):
        read_hostfile(path)


def test_read_hostfile_names_the_file(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=1\nb slots=x\n")
    with pytest.raises(HostfileError, match=f"{path} line 2"):
        read_hostfile(path)


def test_no_filter_selects_everything():
    pool = parse_hostfile_text(POOL_TEXT)
    assert select_resources(pool) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "10.0.0.7": [0, 1]}


def test_include_hosts_and_slots_in_hostfile_order():
    pool = parse_hostfile_text(POOL_TEXT)
    assert select_resources(pool, include="10.0.0.7@worker-0:0,2") == {"worker-0": [0, 2], "10.0.0.7": [0, 1]}
    assert select_resources(pool, include="worker-1:3,1@worker-1:1") == {"worker-1": [1, 3]}


def test_exclude_slots_and_whole_hosts():
    pool = parse_hostfile_text(POOL_TEXT)
    assert select_resources(pool, exclude="worker-1@worker-0:1") == {"worker-0": [0, 2, 3], "10.0.0.7": [0, 1]}
    assert select_resources(pool, exclude="10.0.0.7:0,1") == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


def test_num_nodes_and_num_gpus_apply_after_the_filter():
    pool = parse_hostfile_text(POOL_TEXT)
    assert select_resources(pool, exclude="worker-0", num_nodes=1, num_gpus=2) == {"worker-1": [0, 1]}
    assert select_resources(pool, num_gpus=2) == {"worker-0": [0, 1], "worker-1": [0, 1], "10.0.0.7": [0, 1]}


@pytest.mark.parametrize("kwargs, message", [
    ({"include": "worker-9"}, "--include names host 'worker-9', which is not in the hostfile"),
    ({"exclude": "worker-9:0"}, "--exclude names host 'worker-9'"),
    ({"include": "worker-0:4"}, r"slot\(s\) \[4\] of host 'worker-0', which has slots 0..3"),
    ({"include": "10.0.0.7:0,5,9"}, r"slot\(s\) \[5, 9\]"),
    ({"include": "worker-0:a"}, "must be comma-separated integers"),
    ({"include": "worker-0@"}, "empty host entry"),
    ({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive"),
    ({"exclude": "worker-0@worker-1@10.0.0.7"}, "no slots left"),
    ({"num_nodes": 4}, "--num_nodes 4 but only 3 host"),
    ({"num_gpus": 3}, r"--num_gpus 3 but these hosts have fewer selected slots: \{'10.0.0.7': 2\}"),
    ({"include": "bad;host"}, "is not a valid host name"),
])
def test_selection_errors(kwargs, message):
    with pytest.raises(HostfileError, match=message):
        select_resources(parse_hostfile_text(POOL_TEXT), **kwargs)
