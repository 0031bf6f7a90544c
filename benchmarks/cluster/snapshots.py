"""In-memory snapshots on the emulated cluster (as root): what they cost a step, and how fast a restart
resumes from them against the checkpoint in storage of the same iteration.

    python -m benchmarks.cluster.snapshots --profile h100 --hosts 2 --ranks-per-host 1 \\
        --out benchmarks/results/snapshots.md

A ZeRO-3 GPT (12 layers, hidden 768: the 110M shape at sequence 256), DP across the hosts, links shaped
like the profile's (benchmarks/cluster/profiles.py). Measured in one session:

1. Step time: the median (the first two steps left out) without snapshots, and with a snapshot every
   ``--intervals`` iterations copied to the other host (``--replication``).
2. Restore: a run saving both a storage checkpoint (--save) and a snapshot at iteration ``--at`` is killed
   (every host's torchrun, SIGTERM then SIGKILL, no clean end) after the next step, then restarted three times:
   - from the snapshots, the second host's memory empty (a replacement host: its ranks' files come from the
     copies on the first host over the shaped link) and the storage checkpoint moved away (so nothing can
     be read from storage);
   - from the snapshots, every host's memory intact;
   - from storage, the snapshots moved away, the page cache dropped first where the kernel allows it.
   Each restart's own line gives the seconds of the restore.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cluster.hosts import REPO, ClusterSpec, EmulatedCluster
from benchmarks.cluster.job import JobResult, run_job
from benchmarks.cluster.profiles import PROFILES
from benchmarks.cluster.run import exits_on_cluster_failure, measured_links, shaping_for, stop_on_sigterm

RESTORED = re.compile(r"> restored iteration (\d+) from the in-memory snapshots .* in ([0-9.]+) s: ([0-9.]+) MiB")
LOADED = re.compile(r"> loaded checkpoint .* in ([0-9.]+) s \(resuming at iteration (\d+)")


def model_args(size: tuple[int, int, int], iters: int, global_batch: int) -> list[str]:
    layers, hidden, vocab = size
    return ["pretrain_gpt.py", "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(hidden // 64), "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "2",
            "--global-batch-size", str(global_batch), "--train-iters", str(iters), "--lr", "3e-4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--distributed-backend", "gloo",
            "--log-interval", "1", "--hidden-dropout",
            "0", "--attention-dropout", "0", "--seed", "1234", "--eval-iters", "0",
            "--deepspeed", "--deepspeed_config", str(REPO / "examples" / "ds_config_zero3.json")]


def snapshot_args(ckpt: Path, shm: Path, interval: int, save_interval: int) -> list[str]:
    return ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(save_interval),
            "--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", str(interval),
            "--non-persistent-local-ckpt-dir", str(shm), "--replication"]


def step_times(result: JobResult, skip: int = 2) -> tuple[float, float]:
    """(median, mean) step seconds after the first ``skip``: the mean carries the snapshots' cost (a few steps
    that wait for one), the median the steps that do not."""
    times = [s.seconds for s in result.steps if s.iteration > skip]
    return (statistics.median(times), statistics.fmean(times)) if times else (float("nan"), float("nan"))


def _checked(result: JobResult, what: str, stopped: bool = False) -> JobResult:
    if result.failure and not stopped:
        raise RuntimeError(f"{what}: {result.failure}")
    return result


def _found(pattern: re.Pattern, result: JobResult, what: str) -> re.Match:
    for line in result.output:
        if m := pattern.search(line):
            return m
    tail = "\n".join(result.output[-20:])
    raise RuntimeError(f"{what}: no line matching {pattern.pattern!r}; the last lines:\n{tail}")


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster.snapshots", description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=[*PROFILES, "none"], default="h100")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--size", type=int, nargs=3, default=[4, 256, 4096], metavar=("LAYERS", "HIDDEN", "VOCAB"),
                   help="the GPT's layers, hidden size and vocabulary (sequence 256, micro-batch 2)")
    p.add_argument("--iters", type=int, default=12, help="iterations of each step-time run")
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 4], help="snapshot intervals to time")
    p.add_argument("--at", type=int, default=4, help="iteration of the snapshot and checkpoint restored")
    p.add_argument("--flops-per-rank", type=float, help="this machine's FLOP/s per rank (skips measuring)")
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="the memory filesystem for the snapshots")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    if a.hosts < 2:
        p.error("give --hosts 2 or more (the copies go to another host)")
    stop_on_sigterm()
    spec = ClusterSpec(a.hosts, a.ranks_per_host)
    gbs = 2 * a.hosts * a.ranks_per_host
    size = tuple(a.size)
    lines = []
    with exits_on_cluster_failure("benchmarks.cluster.snapshots"), \
            tempfile.TemporaryDirectory(prefix="ptm-snap-") as work, \
            tempfile.TemporaryDirectory(prefix="ptm-snap-", dir=a.shm) as memory:
        links = measured_links(a.profile, a.hosts, a.ranks_per_host, a.flops_per_rank, a.max_delay_ms)
        with EmulatedCluster(spec, shaping_for(links)) as cluster:
            if links is not None:
                lines.append(links.line(cluster.delays_applied))
                print(lines[-1], flush=True)
            rows = []
            plain = _checked(run_job(spec, model_args(size, a.iters, gbs), 1800), "no snapshots")
            base = step_times(plain)
            rows.append(("none", base))
            print(f"no snapshots: step median {base[0]:.3f} s, mean {base[1]:.3f} s", flush=True)
            for interval in a.intervals:
                ckpt, shm = Path(work) / f"steps{interval}", Path(memory) / f"steps{interval}"
                argv = model_args(size, a.iters, gbs) + snapshot_args(ckpt, shm, interval, 10_000)
                run = _checked(run_job(spec, argv, 1800), f"snapshots every {interval}")
                rows.append((f"every {interval}", step_times(run)))
                print(f"snapshots {rows[-1][0]}: step median {rows[-1][1][0]:.3f} s, mean {rows[-1][1][1]:.3f} s",
                      flush=True)
                lines += [f"every {interval}, the last one: {line.split(': > ', 1)[1]}" for line in run.output
                          if "> snapshot of iteration" in line][-1:]
            table = ["", "| snapshots | median step (s) | mean step (s) | overhead (mean) |", "|---|---|---|---|"]
            table += [f"| {name} | {t[0]:.3f} | {t[1]:.3f} | {t[1] / base[1] - 1:+.1%} |" for name, t in rows]
            lines += table

            ckpt, shm = Path(work) / "restore", Path(memory) / "restore"
            args = model_args(size, a.at + 3, gbs) + snapshot_args(ckpt, shm, a.at, a.at)
            _checked(run_job(spec, args, 1800, stop_at=re.compile(rf"iteration\s+{a.at + 1}/")), "the run to kill",
                     stopped=True)
            hosts = sorted(shm.iterdir())
            first_step = re.compile(rf"iteration\s+{a.at + 1}/")
            # 1: the second host's memory is empty, storage moved away: only the first host's copies remain.
            aside_ckpt, aside_second = Path(work) / "ckpt-aside", Path(memory) / "second-aside"
            ckpt.rename(aside_ckpt)
            shutil.copytree(hosts[1], aside_second)
            shutil.rmtree(hosts[1])
            res = _checked(run_job(spec, args, 1800, stop_at=first_step), "restore with a host's memory lost", True)
            m = _found(RESTORED, res, "restore with a host's memory lost")
            peer = (float(m[2]), float(m[3]))
            shutil.rmtree(ckpt)  # what the restarted run made there (its log)
            aside_ckpt.rename(ckpt)
            shutil.rmtree(hosts[1], ignore_errors=True)
            aside_second.rename(hosts[1])
            # 2: every host's memory intact.
            res = _checked(run_job(spec, args, 1800, stop_at=first_step), "restore from memory", True)
            own = float(_found(RESTORED, res, "restore from memory")[2])
            # 3: storage only.
            shm.rename(Path(memory) / "restore-aside")
            cold = drop_page_cache()
            res = _checked(run_job(spec, args, 1800, stop_at=first_step), "restore from storage", True)
            storage = float(_found(LOADED, res, "restore from storage")[1])
        state_mib = sum(f.stat().st_size for f in ckpt.glob(f"iter_{a.at:07d}/*")) / 2**20
    def versus(seconds: float) -> str:
        return f"{storage / seconds:.1f}x faster" if seconds <= storage else f"{seconds / storage:.1f}x slower"
    lines += ["", f"Restore of iteration {a.at} ({a.hosts} hosts x {a.ranks_per_host} ranks):", "",
              "| restored from | seconds | vs storage |", "|---|---|---|",
              f"| snapshots, the second host's memory lost ({peer[1]:.1f} MiB copied from the other host; storage "
              f"moved away) | {peer[0]:.2f} | {versus(peer[0])} |",
              f"| snapshots, every host's memory intact | {own:.2f} | {versus(own)} |",
              f"| storage (--load){', page cache dropped first' if cold else ', page cache warm'} | {storage:.2f} | "
              f"1.0x |"]
    if state_mib:
        lines.append(f"\nstate saved per iteration: {state_mib:.0f} MiB")
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
