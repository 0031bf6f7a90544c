"""graceful_torchrun.py: SIGTERM to torchrun reaches its workers, which save and exit; torchrun then exits 0.
It uses torch's public interfaces only, so that a torch upgrade that changes torch's internals does not break it."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys

import pytest
from torch.distributed import run as torchrun

from ptm_launch.commands import TORCHRUN_PATH
from ptm_launch.graceful_torchrun import torchrun_argv
from tests.launcher.launch_utils import REPO

# A worker that, like pretrain_gpt.py --exit-signal-handler, finishes its "step" after a signal and exits 0.
SAVING_WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
print(f"worker {os.environ['RANK']} ready", flush=True)
while not got:
    time.sleep(0.05)
time.sleep(1.0)  # the step and the save
print(f"worker {os.environ['RANK']} saved after {signal.Signals(got[0]).name}", flush=True)
"""
# One without a handler: the signal kills it, and with restarts left torchrun must not start it again.
PLAIN_WORKER = """
import os, time
print(f"worker {os.environ['RANK']} ready", flush=True)
time.sleep(1000)
"""


def _torchrun(tmp_path, worker: str, *flags: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    return subprocess.Popen([sys.executable, "-u", TORCHRUN_PATH, "--standalone", "--nproc-per-node", "2", *flags,
                             str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_ready(proc: subprocess.Popen, lines: list[str]) -> None:
    ready = 0
    for line in proc.stdout:
        lines.append(line)
        ready += line.count("ready")  # two workers' prints may share a line
        if ready >= 2:
            return
    raise AssertionError("".join(lines))


@pytest.mark.multiprocess
@pytest.mark.parametrize("restarts", ["0", "2"])
def test_sigterm_to_torchrun_lets_the_workers_finish_and_exits_zero(tmp_path, restarts):
    proc = _torchrun(tmp_path, SAVING_WORKER, "--max-restarts", restarts)
    lines: list[str] = []
    _wait_ready(proc, lines)
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) == 0, out
    assert out.count("saved after SIGTERM") == 2, out
    assert "torchrun: SIGTERM received: passed to its 2 worker(s) as SIGTERM" in out
    assert "Traceback" not in out and "SignalException" not in out


@pytest.mark.multiprocess
def test_the_whole_process_group_signalled_at_once_is_one_preemption(tmp_path):
    proc = _torchrun(tmp_path, SAVING_WORKER)
    lines: list[str] = []
    _wait_ready(proc, lines)
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun only: the workers have sessions of their own
    for _ in range(2):
        proc.send_signal(signal.SIGTERM)  # copies by other paths (the node agent)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) == 0, out
    assert out.count("saved after SIGTERM") == 2 and out.count("torchrun: SIGTERM received") == 1, out


@pytest.mark.multiprocess
def test_workers_killed_by_the_signal_are_not_restarted(tmp_path):
    proc = _torchrun(tmp_path, PLAIN_WORKER, "--max-restarts", "3")
    lines: list[str] = []
    _wait_ready(proc, lines)
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=60) != 0, out
    assert out.count("ready") == 2, f"workers were started again:\n{out}"


def _root_name(node: ast.expr) -> str | None:
    """``a`` of ``a.b.c``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_torch_names(source: str) -> list[str]:
    """Every private torch name ``source`` imports, reads or assigns: a module or name starting with ``_`` in a
    torch import, an attribute starting with ``_`` of a name bound by one, and any setattr on such a name."""
    tree = ast.parse(source)
    from_torch: set[str] = set()  # names that a torch import binds
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".") + [alias.name for alias in node.names]
            found += [f"{node.module}: {part}" for part in parts if part.startswith("_")]
            from_torch |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
                    from_torch.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            owner = node.value
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
            owner = node.args[0]
        else:
            continue
        if _root_name(owner) in from_torch:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_it_touches_no_private_torch_name():
    with open(TORCHRUN_PATH, encoding="utf-8") as f:
        assert _private_torch_names(f.read()) == []
    # The check itself catches what the earlier version did (replace two of torch's private hooks) and the like.
    patched = ("from torch.distributed.elastic.agent.server import api as agent_api\n"
               "from torch.distributed.elastic.multiprocessing import api as mp_api\n"
               "import torch._dynamo\n"
               "mp_api._terminate_process_handler = print\n"
               "setattr(agent_api.SimpleElasticAgent, '_restart_workers', print)\n"
               "from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler\n")
    assert _private_torch_names(patched) == [
        "torch._dynamo", "torch.distributed.elastic.multiprocessing.api: _terminate_process_handler",
        "line 4: mp_api._terminate_process_handler",
        "line 5: setattr(agent_api.SimpleElasticAgent, '_restart_workers', print)"]


@pytest.mark.parametrize("argv", [["--standalone", "--signals-to-handle", "SIGTERM,SIGUSR2", "train.py", "--lr", "1"],
                                  ["--signals-to-handle=SIGTERM,SIGUSR2", "--standalone", "--", "train.py", "--lr",
                                   "1"]])
def test_torchrun_leaves_the_graceful_signals_to_it(argv):
    args = torchrun.parse_args(torchrun_argv(argv))
    assert args.signals_to_handle == "SIGUSR2"
    assert (args.training_script, args.training_script_args) == ("train.py", ["--lr", "1"])
