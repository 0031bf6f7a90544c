"""Command lines per node, shell quoting (checked by running them in a real shell), environment forwarding."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ptm_launch.commands import AGENT_PATH, TORCHRUN_PATH, remote_shell_command
from ptm_launch.config import config_from_args
from ptm_launch.env import EnvFileError, env_file_values, forwarded_environ, parse_env_file
from ptm_launch.hostfile import HostfileError
from ptm_launch.runner import plan, with_rdzv_id

HOSTS = "node-a slots=2\nnode-b slots=2\n"
ENVIRON = {"PYTHONPATH": "/src", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
           "TORCH_DISTRIBUTED_DEBUG": "INFO", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "do-not-send",
           "CUDA_VISIBLE_DEVICES": "5", "PDSH_SSH_ARGS_APPEND": "-F cfg"}
EVIL = ["a b", "; touch pwned1", "$(touch pwned2)", "`touch pwned3`", "--x='y\"z'", "", "*", "\n"]


def _plan(tmp_path: Path, *argv: str, hosts: str = HOSTS, environ: dict | None = None):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hosts)
    environ = environ if environ is not None else ENVIRON
    cfg = with_rdzv_id(config_from_args(["--hostfile", str(hostfile), *argv, "train.py", "--lr", "0.1"]), environ)
    return plan(cfg, environ, tmp_path, tmp_path / "home", "/opt/py/bin/python")


def _remote(node) -> tuple[list[str], list[str]]:
    """(ssh argv before the remote command, the remote command split the way the remote shell splits it)."""
    return list(node.argv[:-1]), shlex.split(node.argv[-1])


def _torchrun_flags(words: list[str]) -> dict[str, str]:
    start = words.index(TORCHRUN_PATH) + 1
    flags = words[start:words.index("train.py")]
    return {flags[i]: flags[i + 1] for i in range(0, len(flags), 2)}


@pytest.mark.multiprocess
def test_remote_command_survives_a_real_shell_unchanged(tmp_path):
    workdir = tmp_path / "dir with 'quote' and $HOME"
    workdir.mkdir()
    exports = {"A": "x y; $(touch pwned4)", "B": "'\"`touch pwned5`"}
    probe = "import json,os,sys; print(json.dumps([os.getcwd(), os.environ['A'], os.environ['B'], sys.argv[1:]]))"
    command = remote_shell_command(str(workdir), exports, [sys.executable, "-c", probe, *EVIL])
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [str(workdir), exports["A"], exports["B"], EVIL]
    assert not list(tmp_path.rglob("pwned*")), "a quoted argument was executed by the shell"


def test_two_hosts_one_torchrun_each_in_hostfile_order(tmp_path):
    nodes = _plan(tmp_path, "--launcher_args", "-F my_config -o ServerAliveInterval=2", "--ssh_port", "2222")
    assert [(n.host, n.node_rank, n.slots) for n in nodes] == [("node-a", 0, (0, 1)), ("node-b", 1, (0, 1))]
    for node in nodes:
        ssh, words = _remote(node)
        # user options first (ssh keeps the first value), then ours, then "--" so a host is never an option
        assert ssh == ["ssh", "-F", "my_config", "-o", "ServerAliveInterval=2", "-p", "2222", "-o", "BatchMode=yes",
                       "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3", "--",
                       node.host]
        assert words[:5] == ["cd", str(tmp_path), "&&", "exec", "env"]
        assert _torchrun_flags(words) == {"--nnodes": "2", "--nproc-per-node": "2", "--node-rank": str(node.node_rank),
                                          "--master-addr": "node-a", "--master-port": "29500"}
        assert words[words.index("train.py"):] == ["train.py", "--lr", "0.1"]
        agent = words.index(AGENT_PATH)
        assert words[agent - 2:agent] == ["/opt/py/bin/python", "-u"] and "--watch-stdin" in words
        assert node.output_prefix == f"{node.host}: "


def test_forwarded_environment_and_env_file(tmp_path):
    (tmp_path / ".ptm_env").write_text("NCCL_IB_DISABLE=1\nexport MY_FLAG='a b'\n")
    words = _remote(_plan(tmp_path)[1])[1]
    exports = dict(w.split("=", 1) for w in words[words.index("env") + 1:words.index("/opt/py/bin/python")])
    assert exports == {"PYTHONPATH": "/src", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
                       "TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "MY_FLAG": "a b",
                       "LOGLEVEL": "INFO"}  # torchrun's agent log: the launcher reads its events


def test_slot_subset_pins_devices_and_master_can_be_set(tmp_path):
    nodes = _plan(tmp_path, "--include", "node-a@node-b:1", "--master_addr", "10.1.1.1", "--master_port", "6000")
    words_a, words_b = _remote(nodes[0])[1], _remote(nodes[1])[1]
    assert "CUDA_VISIBLE_DEVICES=1" in words_b and not any(w.startswith("CUDA_VISIBLE") for w in words_a)
    assert _torchrun_flags(words_b) == {"--nnodes": "2", "--nproc-per-node": "1", "--node-rank": "1",
                                        "--master-addr": "10.1.1.1", "--master-port": "6000"}


def test_pdsh_launcher(tmp_path):
    nodes = _plan(tmp_path, "--launcher", "pdsh", "--ssh_port", "2222")
    ssh, words = _remote(nodes[1])
    assert ssh == ["pdsh", "-S", "-w", "node-b"]
    assert nodes[1].env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND":
                            "-F cfg -p 2222 -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=10 "
                            "-o ServerAliveCountMax=3"}
    assert "--watch-stdin" not in words and not nodes[1].stdin_reaches_agent


def test_one_host_runs_locally_unless_forced(tmp_path):
    (node,) = _plan(tmp_path, hosts="node-a slots=4\n", environ={})
    assert node.argv[:3] == ("/opt/py/bin/python", "-u", AGENT_PATH)
    assert "--standalone" in node.argv and node.argv[node.argv.index("--nproc-per-node") + 1] == "4"
    (node,) = _plan(tmp_path, "--force_multi", hosts="node-a slots=4\n", environ={})
    assert node.argv[0] == "ssh" and node.argv[-2] == "node-a"


def test_no_hostfile_runs_num_gpus_cpu_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same plan on a GPU machine
    cfg = config_from_args(["--num_gpus", "3", "--master_port", "7000", "--module", "pkg.train", "--x", "1"])
    (node,) = plan(cfg, {}, tmp_path, tmp_path, sys.executable)
    argv = list(node.argv)
    assert node.host == "localhost" and node.env == {"LOGLEVEL": "INFO"}
    tail = argv[argv.index(TORCHRUN_PATH) + 1:]
    assert tail == ["--nnodes", "1", "--nproc-per-node", "3", "--node-rank", "0", "--master-addr", "127.0.0.1",
                    "--master-port", "7000", "--module", "pkg.train", "--x", "1"]


def test_launcher_args_are_split_and_tilde_expanded():
    cfg = config_from_args(["--launcher_args=-F ~/cfg -o 'ProxyJump=a b'", "t.py"])
    assert cfg.launcher_args == ("-F", str(Path.home() / "cfg"), "-o", "ProxyJump=a b")


def test_script_arguments_that_look_like_launcher_options_go_to_the_script():
    cfg = config_from_args(["--num_gpus", "2", "train.py", "--hostfile", "x", "--num_gpus", "8"])
    assert cfg.user_script == "train.py" and cfg.user_args == ("--hostfile", "x", "--num_gpus", "8")
    assert cfg.hostfile is None and cfg.num_gpus == 2


@pytest.mark.parametrize("argv", [["--num_gpus", "0", "t.py"], ["--master_port", "70000", "t.py"],
                                  ["--module", "--no_python", "t.py"], ["--launcher", "mpirun", "t.py"],
                                  ["--nnodes", "2:1", "--max_restarts", "1", "t.py"],
                                  ["--nnodes", "a:b", "--max_restarts", "1", "t.py"], ["--nnodes", "1:2", "t.py"]])
def test_bad_options_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2 and "ptm-launch: error:" in capsys.readouterr().err


def test_forwarded_environ_prefixes():
    assert forwarded_environ(ENVIRON) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                                          "PYTHONPATH": "/src", "TORCH_DISTRIBUTED_DEBUG": "INFO"}


def test_env_file_parsing():
    text = "# comment\n\nA=1\nexport B = two words \nC=\"quoted $x\"\nD='x'\nE=a=b\n"
    assert parse_env_file(text, "f") == {"A": "1", "B": "two words", "C": "quoted $x", "D": "x", "E": "a=b"}
    for bad in ["no_equals", "1A=x", "A B=x", "$(x)=1"]:
        with pytest.raises(EnvFileError, match="f line 1: expected KEY=VALUE"):
            parse_env_file(bad, "f")


def test_env_file_locations(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".ptm_env").write_text("A=home\nB=home\n")
    (cwd / ".ptm_env").write_text("B=cwd\n")
    assert env_file_values({}, cwd, home) == {"A": "home", "B": "cwd"}
    other = tmp_path / "other_env"
    other.write_text("C=3\n")
    assert env_file_values({"PTM_ENV_FILE": str(other)}, cwd, home) == {"C": "3"}
    with pytest.raises(EnvFileError, match="PTM_ENV_FILE=.* does not exist"):
        env_file_values({"PTM_ENV_FILE": str(tmp_path / "missing")}, cwd, home)


def test_restarts_use_c10d_rendezvous_in_host_name_order(tmp_path):
    hosts = "node-b slots=2\nnode-a slots=1\n"
    nodes = _plan(tmp_path, "--max_restarts", "3", "--master_port", "6001", hosts=hosts, environ={})
    # The rendezvous ranks nodes by address (--local-addr): the plan lays them out the same way, the first
    # hosting the store.
    assert [(n.host, n.node_rank, n.slots) for n in nodes] == [("node-a", 0, (0,)), ("node-b", 1, (0, 1))]
    for node in nodes:
        words = _remote(node)[1]
        flags = _torchrun_flags(words)
        assert flags == {"--nnodes": "2", "--nproc-per-node": str(len(node.slots)), "--rdzv-backend": "c10d",
                         "--rdzv-endpoint": "node-a:6001", "--rdzv-id": flags["--rdzv-id"],
                         "--rdzv-conf": f"is_host={int(node.node_rank == 0)}", "--local-addr": node.host,
                         "--max-restarts": "3"}
        assert "--node-rank" not in words
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in words
    ids = {_torchrun_flags(_remote(n)[1])["--rdzv-id"] for n in nodes}
    assert len(ids) == 1 and ids.pop().startswith("ptm-")


def test_an_elastic_range_goes_to_every_torchrun_and_must_hold_the_selected_hosts(tmp_path):
    nodes = _plan(tmp_path, "--nnodes", "1:2", "--max_restarts", "1", hosts="node-b slots=2\nnode-a slots=2\n",
                  environ={})
    assert [_torchrun_flags(_remote(n)[1])["--nnodes"] for n in nodes] == ["1:2", "1:2"]
    with pytest.raises(HostfileError, match=r"--nnodes 3:4, but 2 host\(s\) are selected from .*hostfile: select 3 "
                                            r"to 4 hosts or change the range"):
        _plan(tmp_path, "--nnodes", "3:4", "--max_restarts", "1", hosts="node-b slots=2\nnode-a slots=2\n",
              environ={})


def test_nodes_started_again_get_the_restarts_that_are_left(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTS)
    cfg = with_rdzv_id(config_from_args(["--hostfile", str(hostfile), "--max_restarts", "4", "t.py"]), {})
    first = plan(cfg, {}, tmp_path, tmp_path, "/py")
    again = plan(cfg, {}, tmp_path, tmp_path, "/py", max_restarts=1)
    for before, after in zip(first, again):
        flags_before, flags_after = _torchrun_flags_of(before), _torchrun_flags_of(after)
        assert flags_before["--max-restarts"] == "4" and flags_after["--max-restarts"] == "1"
        assert flags_before["--rdzv-id"] == flags_after["--rdzv-id"]  # the same rendezvous


def _torchrun_flags_of(node) -> dict[str, str]:
    words = shlex.split(node.argv[-1])
    start = words.index(TORCHRUN_PATH) + 1
    flags = words[start:words.index("t.py")]
    return {flags[i]: flags[i + 1] for i in range(0, len(flags), 2)}


def test_one_local_node_with_restarts(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = with_rdzv_id(config_from_args(["--num_gpus", "2", "--max_restarts", "2", "t.py"]), {"LOGLEVEL": "WARNING"})
    (node,) = plan(cfg, {"LOGLEVEL": "WARNING"}, tmp_path, tmp_path, sys.executable)
    argv = list(node.argv)
    assert argv[argv.index(TORCHRUN_PATH) + 1:] == ["--nnodes", "1", "--nproc-per-node", "2",
                                                               "--standalone", "--max-restarts", "2", "t.py"]
    assert node.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # the user's LOGLEVEL is left alone


SLURM_ENV = {"SLURM_JOB_NODELIST": "gpu[02-03]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4",
             "SLURM_JOB_ID": "4711", "SLURM_NTASKS_PER_NODE": "1"}


def test_slurm_launcher_runs_one_srun_step_per_node(tmp_path):
    cfg = with_rdzv_id(config_from_args(["--launcher", "slurm", "--max_restarts", "2",
                                         "--launcher_args=--cpus-per-task=32", "train.py", "--lr", "0.1"]), SLURM_ENV)
    nodes = plan(cfg, SLURM_ENV, tmp_path, tmp_path, "/opt/py/bin/python")
    assert [(n.host, n.node_rank, n.slots) for n in nodes] == [("gpu02", 0, (0, 1, 2, 3)), ("gpu03", 1, (0, 1, 2, 3))]
    for node in nodes:
        argv = list(node.argv)
        agent = argv.index(AGENT_PATH)
        assert argv[:agent - 2] == ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node.host}",
                                    f"--job-name=ptm-node-{node.host}", "--kill-on-bad-exit=1", "--cpus-per-task=32"]
        flags = _torchrun_flags(argv)
        assert flags == {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                         "--rdzv-endpoint": "gpu02:29500", "--rdzv-id": "slurm-4711",
                         "--rdzv-conf": f"is_host={int(node.node_rank == 0)}",
                         "--local-addr": node.host, "--max-restarts": "2"}
        assert argv[-3:] == ["train.py", "--lr", "0.1"]
        assert node.env == {"LOGLEVEL": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        assert node.output_prefix == f"{node.host}: "


def test_slurm_launcher_without_restarts_uses_static_ranks(tmp_path):
    env = {**SLURM_ENV, "SLURM_GPUS_ON_NODE": "0", "SLURM_GPUS_PER_NODE": "", "SLURM_NTASKS_PER_NODE": "3"}
    cfg = config_from_args(["--launcher", "slurm", "--exclude", "gpu02", "train.py"])
    (node,) = plan(cfg, env, tmp_path, tmp_path, "/py")
    assert node.host == "gpu03" and _torchrun_flags(list(node.argv)) == {
        "--nnodes": "1", "--nproc-per-node": "3", "--node-rank": "0", "--master-addr": "gpu03",
        "--master-port": "29500"}


def test_slurm_launcher_outside_an_allocation_is_a_clear_error(tmp_path):
    cfg = config_from_args(["--launcher", "slurm", "train.py"])
    with pytest.raises(HostfileError, match="SLURM_JOB_NODELIST is not set; run ptm-launch inside an allocation"):
        plan(cfg, {}, tmp_path, tmp_path, "/py")
    with pytest.raises(SystemExit):
        config_from_args(["--launcher", "slurm", "--hostfile", "h", "train.py"])
