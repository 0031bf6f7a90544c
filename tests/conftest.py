"""Suite-wide test tiers.

``@pytest.mark.multiprocess`` marks a test that starts processes (distributed ranks, launchers, data-loader
workers, Python or shell subprocesses); ``bash scripts/test.sh -m "not multiprocess"`` is the fast tier. A
test without the mark that starts such a process fails at that point, so the fast tier stays fast.
"""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys

import pytest

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
