"""Suite-wide test tiers and order.

``@pytest.mark.multiprocess`` marks a test that starts processes (distributed ranks, launchers, data-loader
workers, Python or shell subprocesses); ``bash scripts/test.sh -m "not multiprocess"`` is the fast tier. A
test without the mark that starts such a process fails at that point, so the fast tier stays fast.

The files that take longest run first (longest-processing-time-first): with several pytest-xdist workers
and one file per worker, a long file started last would otherwise keep one worker busy alone at the end.
"""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys

import pytest

# Longest first, by the seconds `--durations` reports on the 2-core test machine (each over a minute).
SLOWEST_FILES = ("tests/launcher/test_multinode.py", "tests/launcher/test_slurm.py",
                 "tests/launcher/test_restarts.py", "tests/launcher/test_local_launch.py",
                 "tests/examples/test_start_sh.py", "tests/launcher/test_error_lines.py",
                 "tests/training/test_preemption.py", "tests/tools/test_plan_memory.py",
                 "tests/data/test_preprocess.py", "tests/training/test_async_save.py",
                 "tests/launcher/test_preemption.py")
_SLOW_PROGRAMS = ("python", "bash", "sh", "torchrun", "ssh", "pdsh", "ip")
_MESSAGE = ("this test starts a process but is not marked @pytest.mark.multiprocess; mark it (module-level "
            "pytestmark for a module of such tests)")


def _refuse_start(*_args, **_kwargs):
    raise RuntimeError(_MESSAGE)


def _guarded_popen(original):
    def init(self, args, *rest, **kwargs):
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        name = os.path.basename(os.fsdecode(program)).split()[0]
        if os.fsdecode(program) == sys.executable or name.startswith(_SLOW_PROGRAMS) or name.startswith("ptm-"):
            raise RuntimeError(_MESSAGE)
        original(self, args, *rest, **kwargs)
    return init


@pytest.fixture(autouse=True)
def _processes_need_the_mark(request, monkeypatch):
    if request.node.get_closest_marker("multiprocess") is None:
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse_start)
        monkeypatch.setattr(subprocess.Popen, "__init__", _guarded_popen(subprocess.Popen.__init__))
    yield


def pytest_collection_modifyitems(items):
    first = {path: i for i, path in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: file order kept


@pytest.fixture(scope="module")
def single_rank():
    """A one-rank gloo group (and a TP = PP = 1 mesh) in the test process, for checks that need the mesh but not
    several ranks."""
    import datetime

    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
