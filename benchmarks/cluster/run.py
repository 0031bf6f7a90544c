"""Run a torchrun job on an emulated cluster whose links are shaped like a real one's (as root).

    python -m benchmarks.cluster.run --profile h100 --hosts 2 --ranks-per-host 2 -- pretrain_gpt.py ...
    python -m benchmarks.cluster.run --profile none --hosts 2 --ranks-per-host 2 -- \\
        benchmarks/cluster/allreduce_probe.py 1048576

Measures this machine's fp32 matmul rate per rank with all hosts x ranks running at once (or takes
``--flops-per-rank``), derives the link rates from the profile (benchmarks/cluster/profiles.py), prints the
derivation, brings the hosts up with those links, runs the job, and prints per step the trainer's time and
the inter-host (eth0) and intra-host (lo) bytes the kernel counted; the hosts are removed afterwards, also
on failure or Ctrl-C. ``--profile none``: unshaped links.
"""
from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.cluster import compute
from benchmarks.cluster.hosts import ClusterError, ClusterSpec, EmulatedCluster, Shaping, parse_topologies
from benchmarks.cluster.job import JobResult, run_job, summarize
from benchmarks.cluster.profiles import PROFILES, EmulatedLinks, derive

MIB = 2**20


def shaping_for(links: EmulatedLinks | None) -> Shaping:
    if links is None:
        return Shaping()
    return Shaping(links.inter_rate_bps, round(links.inter_delay_applied_s * 1e6), links.intra_rate_bps,
                   round(links.intra_delay_applied_s * 1e6))


def measured_links(profile: str, hosts: int, ranks_per_host: int, flops_per_rank: float | None,
                   max_delay_ms: float, seconds: float = 3.0) -> EmulatedLinks | None:
    """The profile's links for this machine; the matmul rate is measured unless given."""
    if profile == "none":
        return None
    if flops_per_rank is None:
        flops_per_rank, per_rank = compute.flops_per_rank(hosts * ranks_per_host, seconds)
        print(f"matmul fp32 {compute.MATMUL_SIZE}^3, {hosts * ranks_per_host} single-threaded ranks at once: "
              f"{', '.join(f'{f / 1e9:.2f}' for f in per_rank)} GFLOP/s per rank (mean {flops_per_rank / 1e9:.2f})",
              flush=True)
    return derive(PROFILES[profile], flops_per_rank, ranks_per_host, max_delay_ms / 1e3)


def report(result: JobResult) -> list[str]:
    """Per step and the medians, as printed after the job."""
    lines = []
    for s in result.steps:
        engine = f", engine {s.engine_bytes / MIB:.2f} MiB (logging rank)" if s.engine_bytes is not None else ""
        lines.append(f"step {s.iteration}: {s.seconds:.2f} s, inter-host {s.links.inter / MIB:.2f} MiB, "
                     f"intra-host {s.links.intra / MIB:.2f} MiB{engine}")
    summary = summarize(result)
    if summary:
        engine = f", engine {summary.engine_bytes / MIB:.2f} MiB" if summary.engine_bytes is not None else ""
        lines.append(f"per step (median of {summary.steps}): {summary.seconds:.2f} s, inter-host "
                     f"{summary.inter_bytes / MIB:.2f} MiB, intra-host {summary.intra_bytes / MIB:.2f} MiB{engine}")
    lines.append(f"whole job (start-up included): inter-host {result.total.inter / MIB:.2f} MiB, intra-host "
                 f"{result.total.intra / MIB:.2f} MiB")
    return lines


def cluster_choice(parser: argparse.ArgumentParser,
                   args: argparse.Namespace) -> tuple[list[tuple[int, int]], list[str]]:
    """--topologies and --profiles checked: (hosts, ranks per host) pairs and profile names; a bad one ends the
    script with argparse's one-line error."""
    try:
        topologies = parse_topologies(args.topologies)
    except ValueError as e:
        parser.error(f"--topologies {e}")
    profiles = args.profiles.split(",")
    if unknown := [p for p in profiles if p not in PROFILES]:
        parser.error(f"--profiles: unknown {unknown}; known: {', '.join(PROFILES)}")
    return topologies, profiles


def shaped_clusters(topologies: list[tuple[int, int]], profiles: list[str], max_delay_ms: float,
                    derivations: list[str]) -> Iterator[tuple[int, int, str, ClusterSpec]]:
    """For each topology (hosts x ranks per host) the emulated hosts, up for all of its profiles, and for each
    profile their links shaped to it: yields (hosts, ranks, profile, spec). Prints this machine's compute per rank
    and every derivation, and appends the derivation lines to ``derivations``. Iterate it inside
    ``exits_on_cluster_failure``: the hosts are gone when the loop ends, by an exception too."""
    for hosts, ranks in topologies:
        flops, per_rank = compute.flops_per_rank(hosts * ranks)
        print(f"{hosts}x{ranks}: {hosts * ranks} ranks at once: {flops / 1e9:.2f} GFLOP/s fp32 per rank "
              f"({', '.join(f'{f / 1e9:.2f}' for f in per_rank)})", flush=True)
        spec = ClusterSpec(hosts, ranks)
        with EmulatedCluster(spec) as cluster:
            for name in profiles:
                links = derive(PROFILES[name], flops, ranks, max_delay_ms / 1e3)
                cluster.shape(shaping_for(links))
                line = f"{hosts}x{ranks}: {links.line(cluster.delays_applied)}"
                print(line, flush=True)
                derivations.append(f"- {line}")
                yield hosts, ranks, name, spec


@contextmanager
def exits_on_cluster_failure(prog: str):
    """A ClusterError or an interrupt (Ctrl-C, SIGTERM) ends ``prog`` with one line and exit code 1 or 130; the
    hosts are gone by then (their context has exited)."""
    try:
        yield
    except ClusterError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; no host is left", file=sys.stderr)
        raise SystemExit(130) from None


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, through the jobs' and the hosts' teardown."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster.run", description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=[*PROFILES, "none"], default="h100")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--flops-per-rank", type=float, help="this machine's FLOP/s per rank (skips measuring)")
    parser.add_argument("--max-delay-ms", type=float, default=5.0, help="clamp for the dilated latencies")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--keep-up", action="store_true", help="leave the hosts up afterwards")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script and its arguments")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the job after --, e.g. -- pretrain_gpt.py ...")
    if args.hosts < 1 or args.ranks_per_host < 1:
        parser.error("--hosts and --ranks-per-host must be at least 1")
    stop_on_sigterm()
    spec = ClusterSpec(args.hosts, args.ranks_per_host)
    with exits_on_cluster_failure("benchmarks.cluster.run"):
        links = measured_links(args.profile, args.hosts, args.ranks_per_host, args.flops_per_rank,
                               args.max_delay_ms)
        with EmulatedCluster(spec, shaping_for(links), keep_up=args.keep_up) as cluster:
            if links is not None:
                print(links.line(cluster.delays_applied), flush=True)
            result = run_job(spec, script, args.timeout_s, echo=print)
    if links is not None:
        print(links.line(cluster.delays_applied))
    print("\n".join(report(result)))
    if result.failure:
        print(f"benchmarks.cluster.run: job failed: {result.failure}", file=sys.stderr)
        return result.returncode if result.returncode > 0 else 128 - result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
