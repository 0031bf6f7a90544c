"""The emulated cluster (benchmarks/cluster): profile arithmetic, and (as root) shaped links between network
namespace hosts, the kernel's byte counters on them, and their teardown."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.cluster import counters, transfer
from benchmarks.cluster.hosts import ClusterSpec, EmulatedCluster, Shaping
from benchmarks.cluster.job import run_job
from benchmarks.cluster.profiles import PROFILES, derive

MIB = 2**20
INTER_BPS = 8_000_000
INTRA_BPS = 32_000_000
# names and addresses of their own: the launcher tests' hosts and a benchmark may be up meanwhile
SPEC = ClusterSpec(hosts=2, ranks_per_host=2, prefix="ptm-ec", subnet="10.79.0", dir=Path("/tmp/ptm-emulated-test"))


def test_profile_scales_rates_by_the_compute_ratio_and_dilates_latency():
    h100 = derive(PROFILES["h100"], local_flops_per_rank=9.89e9, ranks_per_host=2, max_delay_s=5e-3)
    assert h100.ratio == pytest.approx(1e-5)
    assert h100.inter_rate_bps == 8_000_000  # 400 Gb/s per GPU x 1e-5 x 2 GPUs
    assert h100.intra_rate_bps == 72_000_000  # 450 GB/s = 3.6 Tb/s per GPU x 1e-5 x 2 GPUs
    assert h100.inter_delay_s == pytest.approx(0.3)  # 3 us / 1e-5
    assert h100.inter_delay_applied_s == h100.intra_delay_applied_s == 5e-3  # clamped
    a100 = derive(PROFILES["a100-eth"], local_flops_per_rank=3.12e9, ranks_per_host=4)
    assert a100.ratio == pytest.approx(1e-5)
    assert a100.inter_rate_bps == 500_000  # 100 Gb/s per node of 8 = 12.5 Gb/s per GPU x 1e-5 x 4 GPUs
    assert a100.intra_rate_bps == 96_000_000  # 300 GB/s per GPU x 1e-5 x 4
    assert "ratio 1e-05" in a100.line() and "not applied" in a100.line(delays_in_force=False)
    with pytest.raises(ValueError, match="positive"):
        derive(PROFILES["h100"], 0.0, 2)


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def root():
    if os.geteuid() != 0:
        pytest.skip("needs root: the emulated hosts are network namespaces (scripts/multinode_hosts.sh)")


@pytest.fixture(scope="module")
def cluster(root):
    with EmulatedCluster(SPEC, Shaping(inter_rate_bps=INTER_BPS, intra_rate_bps=INTRA_BPS)) as c:
        yield c


@pytest.mark.multiprocess
def test_shaping_limits_inter_and_intra_host_throughput(cluster):
    host1, host2 = SPEC.namespaces
    # about a second each at the configured rate; unshaped, veth and lo move these in milliseconds
    inter = transfer.measure(host1, host2, SPEC.address(1), nbytes=INTER_BPS // 8)
    intra = transfer.measure(host1, host1, SPEC.address(0), nbytes=INTRA_BPS // 8)
    assert 0.7 * INTER_BPS < inter.bits_per_s < 1.15 * INTER_BPS
    assert 0.7 * INTRA_BPS < intra.bits_per_s < 1.15 * INTRA_BPS


@pytest.mark.multiprocess
def test_counters_see_a_ring_allreduce_between_hosts_on_veth_and_within_hosts_on_lo(cluster):
    numel = 262_144
    size = numel * 4
    result = run_job(SPEC, ["benchmarks/cluster/allreduce_probe.py", str(numel)], timeout_s=180)
    assert result.returncode == 0, "\n".join(result.output)
    assert any("sum 10" in line for line in result.output)
    # ring over ranks 0,1 | 2,3: each host sends 2 x 3/4 of the tensor to the other host (ranks 1->2, 3->0)
    # and as much between its own two ranks; the kernel counts headers and start-up traffic on top
    ring = 2 * 3 / 4 * size
    for host in result.total.hosts:
        assert ring <= host.eth0_tx < ring + 0.5 * MIB, result.total
        assert ring <= host.eth0_rx < ring + 0.5 * MIB, result.total
        assert ring <= host.lo_tx < ring + 0.5 * MIB, result.total


@pytest.mark.multiprocess
def test_teardown_removes_every_namespace_also_after_a_failure(root, tmp_path):
    spec = ClusterSpec(hosts=2, ranks_per_host=1, prefix="ptm-ed", subnet="10.80.0", dir=tmp_path / "hosts")
    with pytest.raises(RuntimeError, match="job failed"):
        with EmulatedCluster(spec, Shaping(inter_rate_bps=INTER_BPS)):
            assert sorted(_namespaces("ptm-ed")) == ["ptm-ed-sw", "ptm-ed1", "ptm-ed2"]
            assert counters.read(spec.namespaces).inter >= 0
            raise RuntimeError("job failed")
    assert _namespaces("ptm-ed") == []
    assert not spec.dir.exists()
