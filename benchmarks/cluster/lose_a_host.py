"""Lose a whole host at a random step, again and again: does an elastic job go on, with the right losses, and
how soon (as root)?

    python -m benchmarks.cluster.lose_a_host --hosts 4 --ranks-per-host 2 --min-nodes 2 --tries 10 \\
        --out benchmarks/results/lose_a_host.md

Brings up the emulated hosts (unshaped links), trains the uninterrupted reference once on this machine, then
per try runs ``ptm-launch --nnodes MIN:HOSTS --max_restarts 1`` over ssh from the first host with a ZeRO-3 GPT
(TP 2 inside each host, DP across hosts, checkpoints every 3 iterations) and, at a random iteration, takes a
random host other than the first away as a power loss does: its link down first (no TCP reset reaches anyone),
then every process of it killed. Per try: the iteration of the loss, where training resumed, the seconds from
the loss to the next step trained, and the largest relative difference of any loss from the reference's. The
launcher's ssh options are its defaults (a silent host is noticed after 3 keepalives of 10 s).

``--snapshot-interval N`` adds in-memory snapshots every N iterations copied to the next host (--replication):
the restart then resumes from the newest snapshot that survived, and the table says where each resume read from
and how long the restore took.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.cluster.hosts import REPO, ClusterSpec, EmulatedCluster

ITERS = 20
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
# the trainer's line after a resume: from the in-memory snapshots, or from the checkpoint under --load
RESTORE = re.compile(r"> (restored) iteration \d+ from the in-memory snapshots .* in ([0-9.]+) s|"
                     r"> loaded checkpoint .* in ([0-9.]+) s")


def gpt_args(iters: int, global_batch: int) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", str(global_batch),
            "--train-iters", str(iters), "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--tensor-model-parallel-size", "2", "--distributed-backend", "gloo",
            "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
            "--deepspeed", "--deepspeed_config", str(REPO / "examples" / "ds_config_zero3.json")]


def losses(lines: list[str]) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for line in lines if (m := ITERATION.search(line))}


class Output:
    """A process's output lines as they arrive, each with its arrival time."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.times = proc, [], []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.times.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: re.Pattern, timeout: float, after: int = 0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(after, len(self.lines)):
                if pattern.search(self.lines[i]):
                    return i
            if self.proc.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.1)
        raise TimeoutError(f"no line matching {pattern.pattern!r} within {timeout:.0f} s")


def job_pids(namespace: str, spec: ClusterSpec) -> list[int]:
    listener = int((spec.dir / f"sshd-{spec.namespaces.index(namespace) + 1}.pid").read_text())
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True).stdout
    return [pid for pid in map(int, out.split()) if pid != listener]


def power_loss(namespace: str, spec: ClusterSpec) -> None:
    subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", "down"], check=True)
    for pid in job_pids(namespace, spec):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_try(spec: ClusterSpec, args: list[str], min_nodes: int, rng: random.Random,
            reference: dict[int, float], snapshot_interval: int | None) -> dict:
    victim = rng.randrange(1, spec.hosts)
    lose_after = rng.randrange(4, ITERS - 5)
    with tempfile.TemporaryDirectory(prefix="ptm-lose-") as ckpt, \
            tempfile.TemporaryDirectory(prefix="ptm-lose-", dir="/dev/shm") as memory:
        snapshots = [] if snapshot_interval is None else [
            "--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", str(snapshot_interval),
            "--non-persistent-local-ckpt-dir", memory, "--replication"]
        argv = ["ip", "netns", "exec", spec.namespace(0), sys.executable, "-m", "ptm_launch", "--hostfile",
                str(spec.dir / "hostfile"), "--launcher_args", f"-F {spec.dir / 'ssh_config'}", "--nnodes",
                f"{min_nodes}:{spec.hosts}", "--max_restarts", "1", "pretrain_gpt.py", *args, "--save", ckpt,
                "--load", ckpt, "--save-interval", "3", *snapshots]
        proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        out = Output(proc)
        try:
            return _watch(spec, proc, out, victim, lose_after, reference)
        except (TimeoutError, subprocess.TimeoutExpired):
            tail = "\n".join(out.lines[-40:])
            print(f"host {spec.address(victim)} lost after iteration {lose_after}: the job did not go on; its last "
                  f"lines:\n{tail}", file=sys.stderr, flush=True)
            raise
        finally:
            subprocess.run(["ip", "-n", spec.namespace(victim), "link", "set", "eth0", "up"], check=False)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            for ns in spec.namespaces:
                for pid in job_pids(ns, spec):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _watch(spec: ClusterSpec, proc: subprocess.Popen, out: Output, victim: int, lose_after: int,
           reference: dict[int, float]) -> dict:
    """The loss after iteration ``lose_after``, then the job to its end."""
    seen = out.wait_for(re.compile(rf"iteration\s+{lose_after}/"), timeout=300)
    power_loss(spec.namespace(victim), spec)
    lost_at = time.monotonic()
    left = out.wait_for(re.compile("going on without it"), timeout=120, after=seen)
    model = out.wait_for(re.compile("> model:"), timeout=300, after=left)
    again = out.wait_for(ITERATION, timeout=300, after=model)
    back_s = out.times[again] - lost_at
    code = proc.wait(timeout=600)
    got = {**losses(out.lines[:left]), **losses(out.lines[model:])}
    resumed = int(re.search(r"starting at iteration (\d+)", out.lines[model])[1])
    restore = next((m for line in out.lines[left:model] if (m := RESTORE.search(line))), None)
    worst = max(abs(got[i] - reference[i]) / abs(reference[i]) for i in got)
    complete = sorted(got) == list(range(1, ITERS + 1))
    return {"victim": spec.address(victim), "lost_after": lose_after, "resumed": resumed, "back_s": back_s,
            "worst": worst, "ok": code == 0 and complete and worst <= 1e-5, "code": code,
            "source": "?" if restore is None else "memory" if restore[1] else "storage",
            "restore_s": float(restore[2] or restore[3]) if restore else float("nan"),
            "mesh": re.search(r"mesh (.*?), \d+ micro", out.lines[model])[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--min-nodes", type=int, default=2)
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshot-interval", type=int, default=None,
                   help="also take in-memory snapshots every N iterations, copied to another host")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    if not 1 <= a.min_nodes < a.hosts or a.ranks_per_host != 2:
        p.error("give 1 <= --min-nodes < --hosts and --ranks-per-host 2 (TP 2 inside each host)")
    # The global batch must split over every data-parallel size the job can shrink to (one per host left).
    dp_sizes = range(a.min_nodes, a.hosts + 1)
    global_batch = next(b for b in range(1, 10_000) if all(b % d == 0 for d in dp_sizes))
    args = gpt_args(ITERS, global_batch)
    rng = random.Random(a.seed)
    spec = ClusterSpec(a.hosts, a.ranks_per_host)
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(a.hosts * a.ranks_per_host), "pretrain_gpt.py", *args], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    reference = losses(ref.stdout.splitlines())
    if ref.returncode != 0 or sorted(reference) != list(range(1, ITERS + 1)):
        print(ref.stdout[-3000:], file=sys.stderr)
        print("lose_a_host: the reference run failed (its output is above)", file=sys.stderr)
        return 1
    rows = []
    with EmulatedCluster(spec):
        for n in range(1, a.tries + 1):
            try:
                row = one_try(spec, args, a.min_nodes, rng, reference, a.snapshot_interval)
            except (TimeoutError, subprocess.TimeoutExpired) as exc:  # the job did not go on: that try failed
                row = {"victim": "?", "lost_after": "?", "resumed": "?", "back_s": float("inf"), "worst": float("inf"),
                       "ok": False, "code": str(exc), "mesh": "?", "source": "?", "restore_s": float("nan")}
            rows.append(row)
            print(f"try {n}: {row}", flush=True)
    lines = [f"{a.hosts} hosts x {a.ranks_per_host} ranks, ZeRO-3 GPT (TP 2 per host), global batch {global_batch}, "
             f"--nnodes {a.min_nodes}:{a.hosts}, {ITERS} iterations, checkpoints every 3"
             f"{f', in-memory snapshots every {a.snapshot_interval}' if a.snapshot_interval else ''}; a random host "
             f"other than the first loses its link, then every process",
             "", "| try | host lost | after iteration | resumed from | read from | restore (s) | mesh after | "
             "loss to next step (s) | largest loss difference | finished |", "|---" * 10 + "|"]
    for n, r in enumerate(rows, 1):
        finished = "yes" if r["ok"] else f"NO (exit {r['code']})"
        lines.append(f"| {n} | {r['victim']} | {r['lost_after']} | {r['resumed']} | {r['source']} | "
                     f"{r['restore_s']:.2f} | {r['mesh']} | {r['back_s']:.1f} | {r['worst']:.1e} | {finished} |")
    backs = sorted(r["back_s"] for r in rows)
    lines += ["", f"{sum(r['ok'] for r in rows)}/{len(rows)} finished with the reference's losses (within 1e-5); "
                  f"loss to next step: median {backs[len(backs) // 2]:.1f} s, max {backs[-1]:.1f} s"]
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.write_text(table + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
