"""ptm-launch across real hosts: network namespaces with their own addresses and sshd (needs root).

scripts/multinode_hosts.sh makes two hosts, 10.77.0.1 and 10.77.0.2 (2 slots each), on a bridge of
their own; the launcher runs on the first host, as a user would, and reaches both over ssh/pdsh.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.dist_utils import TORCHRUN
from tests.launcher.launch_utils import (
    REPO,
    STANDIN,
    LiveLauncher,
    gpt_losses_by_iteration,
    is_torchrun,
    run_launcher,
    standin_report,
)
from tests.launcher.standin_train import reference_losses

pytestmark = pytest.mark.multiprocess

SETUP = REPO / "scripts" / "multinode_hosts.sh"
GLOO_ENV = {"GLOO_SOCKET_IFNAME": "eth0"}  # each host's link to the others (its loopback is no use to peers)
KEEPALIVE = ("-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3")  # a silent host is noticed in 6 s
GPT_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--tensor-model-parallel-size", "2", "--distributed-backend", "gloo",
            "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
            "--distributed-timeout-minutes", "2"]


@dataclass(frozen=True)
class Hosts:
    dir: Path
    hostfile: Path
    ssh_config: Path
    namespaces: tuple[str, ...]

    def job_pids(self, namespace: str) -> list[int]:
        """Processes in a host's namespace other than its sshd listener."""
        index = self.namespaces.index(namespace) + 1
        listener = int((self.dir / f"sshd-{index}.pid").read_text())
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True).stdout
        return [pid for pid in map(int, out.split()) if pid != listener]

    def wait_until_idle(self, timeout: float = 30.0, namespaces: tuple[str, ...] = ()) -> dict[str, list[str]]:
        """Poll until no job process is left on the hosts; return what is left (empty when idle)."""
        deadline = time.monotonic() + timeout
        while True:
            left = {ns: [_cmdline(pid) for pid in self.job_pids(ns)] for ns in namespaces or self.namespaces}
            left = {ns: cmds for ns, cmds in left.items() if cmds}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def power_loss(self, namespace: str) -> None:
        """The host goes as a power loss looks: its link down first (no TCP reset reaches anyone), then every
        process of it gone."""
        subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", "down"], check=True)
        for pid in self.job_pids(namespace):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def recover(self, namespace: str, live: LiveLauncher) -> None:
        """After a test that took ``namespace`` away: its link up, the launcher and every job process gone."""
        subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", "up"], check=True)
        if live.proc.poll() is None:
            live.proc.kill()
        self.kill_jobs()

    def kill_jobs(self) -> None:
        """Power-cycle the hosts' workloads (after a test that left a host partitioned)."""
        for ns in self.namespaces:
            for pid in self.job_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return "<exited>"


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0:
        pytest.fail("the multi-node launcher tests must run as root: they create network namespaces and start "
                    "sshd (scripts/multinode_hosts.sh); CI runs them as root")
    if shutil.which("ip") is None and not Path("/usr/sbin/ip").exists():
        pytest.fail("the multi-node launcher tests need iproute2's 'ip' (apt-get install iproute2)")
    try:
        up = subprocess.run(["bash", str(SETUP), "up"], capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, f"{SETUP} up failed:\n{up.stderr}"
        hostfile = Path(up.stdout.strip().splitlines()[-1])
        namespaces = tuple((hostfile.parent / "namespaces").read_text().split())
        yield Hosts(hostfile.parent, hostfile, hostfile.parent / "ssh_config", namespaces)
    finally:
        down = subprocess.run(["bash", str(SETUP), "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, f"{SETUP} down failed:\n{down.stderr}"


def _ssh_args(hosts: Hosts, *extra: str) -> list[str]:
    return ["--hostfile", str(hosts.hostfile), "--launcher_args", " ".join(["-F", str(hosts.ssh_config), *extra])]


def _placement(report: dict) -> list[tuple[int, int, str]]:
    return [(r["rank"], r["local_rank"], r["address"]) for r in report["ranks"]]


TWO_BY_TWO = [(0, 0, "10.77.0.1"), (1, 1, "10.77.0.1"), (2, 0, "10.77.0.2"), (3, 1, "10.77.0.2")]


def test_two_hosts_over_ssh_match_single_process_reference(hosts, tmp_path):
    env_file = tmp_path / "ptm_env"
    env_file.write_text("PTM_TEST_MARKER=x y; $(touch /tmp/ptm-pwned)\n")
    tag = "a b; touch /tmp/ptm-pwned2 `id` 'q'"
    result = run_launcher(*_ssh_args(hosts), STANDIN, "--tag", tag, netns=hosts.namespaces[0],
                          env={**GLOO_ENV, "PTM_ENV_FILE": str(env_file)})
    assert result.returncode == 0, result.stdout
    report = standin_report(result.stdout)
    assert _placement(report) == TWO_BY_TWO  # ranks in hostfile order, local ranks per host
    assert report["allreduce"] == 1.0 + 2.0 + 3.0 + 4.0
    assert [r["env"] for r in report["ranks"]] == ["x y; $(touch /tmp/ptm-pwned)"] * 4
    assert report["tag"] == tag
    assert not Path("/tmp/ptm-pwned").exists() and not Path("/tmp/ptm-pwned2").exists()
    assert report["losses"] == pytest.approx(reference_losses(world=4, steps=5), rel=1e-5)
    assert "10.77.0.2: " in result.stdout  # remote output comes back, labelled with its host
    assert hosts.wait_until_idle() == {}


def test_ctrl_c_with_pdsh_stops_every_node(hosts):
    live = LiveLauncher("--launcher", "pdsh", "--hostfile", str(hosts.hostfile), STANDIN, "--steps", "10000",
                        "--sleep", "0.2", netns=hosts.namespaces[0],
                        env={**GLOO_ENV, "PDSH_SSH_ARGS_APPEND": f"-F {hosts.ssh_config}"})
    live.wait_for("step 1 loss", timeout=120)
    assert _placement(standin_report(live.output)) == TWO_BY_TWO
    live.proc.send_signal(signal.SIGINT)
    assert live.finish(timeout=60) == 128 + signal.SIGINT, live.output
    assert "ptm-launch: SIGINT received: asking every rank to finish its step" in live.output
    assert "ptm-launch: stopped by SIGINT without a clean exit of every rank" in live.output
    assert hosts.wait_until_idle() == {}  # each agent stops its torchrun once its ssh session is gone


def test_node_whose_torchrun_dies_fails_the_job(hosts):
    live = LiveLauncher(*_ssh_args(hosts), STANDIN, "--steps", "10000", "--sleep", "0.2",
                        netns=hosts.namespaces[0], env=GLOO_ENV)
    live.wait_for("step 1 loss", timeout=120)
    second = hosts.namespaces[1]
    (torchrun,) = [pid for pid in hosts.job_pids(second) if is_torchrun(_cmdline(pid).split())]
    os.kill(torchrun, signal.SIGKILL)
    assert live.finish(timeout=90) == 128 + signal.SIGKILL, live.output
    out = live.output
    assert "ptm-launch: node 1 (10.77.0.2) failed; stopping the other node(s)" in out
    assert "10.77.0.2: [ptm-launch agent 10.77.0.2] torchrun was killed by SIGKILL" in out
    assert "10.77.0.1: [ptm-launch agent 10.77.0.1] the launcher closed the connection: asking torchrun's ranks to " \
           "stop" in out
    assert out.rstrip().splitlines()[-1].startswith(
        "ptm-launch: job failed: node 1 (10.77.0.2) lost its torchrun (killed by SIGKILL, exit code 137)")
    assert hosts.wait_until_idle() == {}  # the dead torchrun's orphaned workers were cleaned up too


def test_unreachable_node_fails_the_job_before_the_collective_timeout(hosts):
    # ssh keepalives every 2 s (3 missed = dead) against a 60 s collective timeout: the launcher must
    # notice the silent host itself, blame it, and stop the surviving host, whose ranks are still waiting.
    live = LiveLauncher(*_ssh_args(hosts, *KEEPALIVE), STANDIN,
                        "--steps", "10000", "--sleep", "0.2", "--distributed-timeout-seconds", "60",
                        netns=hosts.namespaces[0], env=GLOO_ENV)
    try:
        live.wait_for("step 1 loss", timeout=120)
        subprocess.run(["ip", "-n", hosts.namespaces[1], "link", "set", "eth0", "down"], check=True)
        assert live.finish(timeout=90) == 255, live.output
        out = live.output
        assert "ptm-launch: job failed: node 1 (10.77.0.2) lost its connection (ssh exit code 255" in out
        assert "Timeout" not in out and "timed out" not in out  # node 0 was stopped, it did not time out
        assert hosts.wait_until_idle(namespaces=hosts.namespaces[:1]) == {}
    finally:
        subprocess.run(["ip", "-n", hosts.namespaces[1], "link", "set", "eth0", "up"], check=True)
        hosts.kill_jobs()  # the partitioned host's ranks would otherwise wait for their own timeout


# A kill lands a few iterations after the line that triggers it (the workers train on until the agent stops
# them; under load both kills here have landed two iterations and a checkpoint late). The second kill comes
# four iterations after the first one's resume point, so 24 leave it room before the job could end.
RESTART_ITERS = 24


def _zero3_args(iters: int) -> list[str]:
    """GPT_ARGS for ``iters`` iterations through the ZeRO-3 engine (shards to reshard when the world changes)."""
    args = list(GPT_ARGS)
    args[args.index("--train-iters") + 1] = str(iters)
    return [*args, "--deepspeed", "--deepspeed_config", str(REPO / "examples" / "ds_config_zero3.json")]


def _restart_args(ckpt: Path, iters: int = RESTART_ITERS) -> list[str]:
    return [*_zero3_args(iters), "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3"]


def _torchrun_pid(hosts: Hosts, namespace: str) -> int:
    (pid,) = [p for p in hosts.job_pids(namespace) if is_torchrun(_cmdline(p).split())]
    return pid


@pytest.fixture(scope="module")
def single_host_losses():
    """The uninterrupted run of _restart_args' model and data (without checkpoints) on one host, 4 ranks."""
    return _single_host_losses(_zero3_args(RESTART_ITERS))


def _single_host_losses(args: list[str]) -> dict[int, str]:
    single = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "4", "pretrain_gpt.py", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert single.returncode == 0, single.stdout
    losses = gpt_losses_by_iteration(single.stdout)
    assert sorted(losses) == list(range(1, int(args[args.index("--train-iters") + 1]) + 1))
    return losses


def test_gpt_survives_each_node_losing_its_torchrun(hosts, tmp_path, single_host_losses):
    """GPT over two hosts trains like one host (TP=2 within each node, DP across), while each node in turn
    loses its torchrun. Node 1: its torchrun is started again and rejoins. Node 0 hosts the rendezvous store,
    so every node starts again. Each time every rank resumes from the last checkpoint, and the losses are the
    reference's."""
    ckpt = tmp_path / "ckpt"
    live = LiveLauncher(*_ssh_args(hosts), "--max_restarts", "2", "pretrain_gpt.py", *_restart_args(ckpt),
                        netns=hosts.namespaces[0], env=GLOO_ENV)
    segments = []  # (victim, restart line, iteration resumed from, first line of the resumed training)
    try:
        seen, kill_after = 0, 7  # checkpoints every 3 iterations: resumes at 6, then (killed after 10) at 9
        for victim in (1, 0):
            seen = live.wait_for(re.compile(rf"iteration\s+{kill_after}/"), timeout=300, after=seen)
            os.kill(_torchrun_pid(hosts, hosts.namespaces[victim]), signal.SIGKILL)
            killed_at = time.monotonic()
            restart = live.wait_for(f"ptm-launch: restart {len(segments) + 1} of 2:", timeout=120, after=seen)
            resumed = int(re.search(r"from iteration (\d+)", live.lines[restart])[1])
            seen = live.wait_for(re.compile(rf"iteration\s+{resumed + 1}/"), timeout=300, after=restart)
            print(f"\nnode {victim}'s torchrun killed -> iteration {resumed + 1} trained again after "
                  f"{live.times[seen] - killed_at:.1f} s")
            segments.append((victim, restart, resumed, seen))
            kill_after = resumed + 4  # past the next checkpoint
        assert live.finish(timeout=300) == 0, live.output
    finally:
        if live.proc.poll() is None:
            live.proc.kill()
            hosts.kill_jobs()
    out = live.output
    assert "ptm-launch: 4 process(es) on 2 node(s): 10.77.0.1 (node 0, ranks 0-1" in out
    reference = {i: float(v) for i, v in single_host_losses.items()}
    before = {i: float(v) for i, v in gpt_losses_by_iteration(live.lines[:segments[0][1]]).items()}
    assert sorted(before) == list(range(1, max(before) + 1)) and max(before) >= 7
    assert before == pytest.approx({i: reference[i] for i in before}, rel=1e-6)
    assert 6 <= segments[0][2] < segments[1][2] and all(seg[2] % 3 == 0 for seg in segments)
    for n, (victim, restart, resumed, again) in enumerate(segments, start=1):
        host = ("10.77.0.1", "10.77.0.2")[victim]
        what = "it hosted the rendezvous, so every node starts again" if victim == 0 else "starting its torchrun again"
        assert f"ptm-launch: node {victim} ({host}) lost its torchrun (killed by SIGKILL, exit code 137); {what}" in out
        assert live.lines[restart].rstrip() == (
            f"ptm-launch: restart {n} of 2: node {victim} ({host}) lost its torchrun (killed by SIGKILL, exit code "
            f"137); restarting all ranks from iteration {resumed} ({ckpt}/latest_checkpointed_iteration.txt); "
            f"{2 - n} restart(s) left")
        assert f"ptm-launch: restart {n}: all 2 node(s) rejoined" in "\n".join(live.lines[restart:])
        end = segments[n][1] if n < len(segments) else len(live.lines)
        retrained = {i: float(v) for i, v in gpt_losses_by_iteration(live.lines[again:end]).items()}
        assert min(retrained) == resumed + 1 and max(retrained) >= (resumed + 4 if n == 1 else RESTART_ITERS)
        # the same values to the bit as the run before the loss, and the single host's within 1e-6
        assert retrained == pytest.approx({i: reference[i] for i in retrained}, rel=1e-6)
        assert {i: v for i, v in before.items() if i in retrained} == pytest.approx(
            {i: v for i, v in retrained.items() if i in before}, rel=0)
        before.update(retrained)
    assert sorted(before) == list(range(1, RESTART_ITERS + 1))
    assert hosts.wait_until_idle() == {}


ELASTIC_ITERS = 40


def _until_sigterm_pending(procs: list[psutil.Process], timeout: float) -> None:
    """Until one of ``procs`` (stopped) has a SIGTERM waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue
            pending = int(re.search(r"^ShdPnd:\s*(\w+)", status, re.M)[1], 16) | \
                int(re.search(r"^SigPnd:\s*(\w+)", status, re.M)[1], 16)
            if pending >> (signal.SIGTERM - 1) & 1:
                return
        time.sleep(0.2)
    raise AssertionError(f"no SIGTERM reached the first host's ranks within {timeout:.0f} s")


def test_elastic_job_goes_on_without_a_host_that_vanished_and_grows_when_it_is_back(hosts, tmp_path):
    """--nnodes 1:2: the second host vanishes as a power loss looks (its link down first, so no TCP reset reaches
    anyone, then every process of it gone). The launcher's ssh keepalive notices, the first host's ranks restart
    alone: TP 2 x DP 1 instead of DP 2, the same global batch in twice the micro-batches, the latest ZeRO-3
    checkpoint resharded, training back within 120 s. When the host answers again, its torchrun joins, the first
    host's ranks save the step they are in (--exit-signal-handler) and all resume from it at DP 2. Every loss
    is the uninterrupted run's."""
    reference = {i: float(v) for i, v in _single_host_losses(_zero3_args(ELASTIC_ITERS)).items()}
    ckpt = tmp_path / "ckpt"
    live = LiveLauncher(*_ssh_args(hosts, *KEEPALIVE), "--nnodes", "1:2", "--max_restarts", "2", "--rejoin_interval",
                        "5", "pretrain_gpt.py", *_restart_args(ckpt, ELASTIC_ITERS), "--exit-signal-handler",
                        netns=hosts.namespaces[0], env=GLOO_ENV)
    second = hosts.namespaces[1]
    try:
        seen = live.wait_for(re.compile(r"iteration\s+7/"), timeout=300)
        hosts.power_loss(second)
        lost_at = time.monotonic()
        left = live.wait_for("going on without it", timeout=60, after=seen)
        alone = live.wait_for("> model:", timeout=180, after=left)
        again = live.wait_for(re.compile(r"iteration\s+\d+/"), timeout=180, after=alone)
        back_s = live.times[again] - lost_at
        print(f"\nsecond host lost -> the first host trains alone {back_s:.1f} s later")
        # The first host alone would finish before the second one is back: its ranks wait (frozen) until the
        # second host's torchrun joined and theirs asks them to stop for the larger round (SIGTERM pending).
        ranks = psutil.Process(_torchrun_pid(hosts, hosts.namespaces[0])).children(recursive=True)
        for rank in ranks:
            rank.suspend()
        try:
            subprocess.run(["ip", "-n", second, "link", "set", "eth0", "up"], check=True)
            _until_sigterm_pending(ranks, timeout=120)
        finally:
            for rank in ranks:
                rank.resume()
        live.wait_for("is back: the job grows to 2 node(s)", timeout=120, after=again)
        stopped = live.wait_for("SIGTERM received: stopping at iteration", timeout=120, after=again)
        both = live.wait_for("> model:", timeout=180, after=stopped)
        assert live.finish(timeout=300) == 0, live.output
    finally:
        hosts.recover(second, live)
    out = live.output
    assert live.lines[left].rstrip().endswith(
        "ptm-launch: node 1 (10.77.0.2) lost its connection (ssh exit code 255: the host died, rebooted or became "
        "unreachable); going on without it on 1 node(s) (at least 1 by --nnodes, the same global batch): their "
        "ranks restart; its host is tried again every 5 s")
    assert "restart 1: all 1 node(s) rejoined" in out and "Traceback" not in out
    start = [int(re.search(r"starting at iteration (\d+)", live.lines[i])[1]) for i in (alone, both)]
    assert "TP=2 PP=1 DP=1, 4 micro-batches of 2 per step" in live.lines[alone] and start[0] in (6, 9)
    assert "TP=2 PP=1 DP=2, 2 micro-batches of 2 per step" in live.lines[both]
    assert start[1] == int(re.search(r"stopping at iteration (\d+)", live.lines[stopped])[1]) > start[0]
    before = {i: float(v) for i, v in gpt_losses_by_iteration(live.lines[:left]).items()}
    by_one = {i: float(v) for i, v in gpt_losses_by_iteration(live.lines[alone:both]).items()}
    by_two = {i: float(v) for i, v in gpt_losses_by_iteration(live.lines[both:]).items()}
    assert min(before) == 1 and max(before) >= 7 and sorted(by_one) == list(range(start[0] + 1, start[1] + 1))
    assert sorted(by_two) == list(range(start[1] + 1, ELASTIC_ITERS + 1))
    for losses in (before, by_one, by_two):  # DP 1: the gradients are summed in another order
        assert losses == pytest.approx({i: reference[i] for i in losses}, rel=1e-5)
    assert back_s < 120


SNAPSHOT_ITERS = 14


def test_lost_host_is_restored_from_the_copies_its_peer_kept_in_memory(hosts, tmp_path):
    """--nnodes 1:2 with snapshots every 2 iterations copied to the other host (--replication) and no checkpoint
    in storage before the end: the second host vanishes (link down, then its processes), and the first host
    alone resumes from the newest snapshot, the second host's shards taken from the copies in its own memory,
    nothing read from storage; the losses are the uninterrupted run's."""
    reference = {i: float(v) for i, v in _single_host_losses(_zero3_args(SNAPSHOT_ITERS)).items()}
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    snapshots = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1000", "--non-persistent-ckpt-type",
                 "local", "--non-persistent-save-interval", "2", "--non-persistent-local-ckpt-dir", str(shm),
                 "--replication"]
    live = LiveLauncher(*_ssh_args(hosts, *KEEPALIVE), "--nnodes", "1:2", "--max_restarts", "1", "pretrain_gpt.py",
                        *_zero3_args(SNAPSHOT_ITERS), *snapshots, netns=hosts.namespaces[0], env=GLOO_ENV)
    second = hosts.namespaces[1]
    try:
        seen = live.wait_for(re.compile(r"iteration\s+7/"), timeout=300)
        hosts.power_loss(second)
        left = live.wait_for("going on without it", timeout=60, after=seen)
        restored = live.wait_for("> restored iteration", timeout=240, after=left)
        assert live.finish(timeout=300) == 0, live.output
    finally:
        hosts.recover(second, live)
    line = live.lines[restored]
    assert re.search(r"restored iteration (4|6) from the in-memory snapshots of 1 host\(s\) .*nothing read from "
                     r"--load", line), line
    assert "loaded checkpoint" not in live.output and "Traceback" not in live.output
    start = int(re.search(r"restored iteration (\d+)", line)[1])
    before = {i: float(v) for i, v in gpt_losses_by_iteration(live.lines[:left]).items()}
    after = {i: float(v) for i, v in gpt_losses_by_iteration(live.lines[restored:]).items()}
    assert max(before) >= 7 and sorted(after) == list(range(start + 1, SNAPSHOT_ITERS + 1))
    for losses in (before, after):  # DP 1 after the loss: the gradients are summed in another order
        assert losses == pytest.approx({i: reference[i] for i in losses}, rel=1e-5)
    # Each host kept its ranks' snapshot files and the other host's copies; the survivor's went at the clean end.
    (survivor,) = [d for d in shm.iterdir() if "-10.77.0.1" in d.name]
    (lost,) = [d for d in shm.iterdir() if "-10.77.0.2" in d.name]
    assert list(survivor.iterdir()) == []
    assert {f.name for d in lost.iterdir() for f in d.iterdir()} >= {f"__{r}_0.distcp" for r in range(4)}
