"""The emulated hosts: scripts/multinode_hosts.sh's network namespaces, with their links shaped (needs root)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "multinode_hosts.sh"


class ClusterError(RuntimeError):
    """The hosts could not be made, shaped or removed; the message names the cause."""


def parse_topologies(text: str) -> list[tuple[int, int]]:
    """``"2x2,4x2"`` -> [(2, 2), (4, 2)] (hosts x ranks per host); ValueError when it is not such a list."""
    try:
        topologies = [tuple(int(x) for x in t.split("x")) for t in text.split(",")]
    except ValueError:
        topologies = []
    if not topologies or any(len(t) != 2 or min(t) < 1 for t in topologies):
        raise ValueError(f"{text}: give HOSTSxRANKS pairs, e.g. 2x2,4x2")
    return topologies


@dataclass(frozen=True)
class Shaping:
    """Per direction; 0: not limited. Rates in bit/s, delays in microseconds."""
    inter_rate_bps: int = 0
    inter_delay_us: int = 0
    intra_rate_bps: int = 0
    intra_delay_us: int = 0


@dataclass(frozen=True)
class ClusterSpec:
    hosts: int
    ranks_per_host: int
    # a name and subnet of their own, so that the launcher tests' hosts (ptm-mn, 10.77.0) may exist meanwhile
    prefix: str = "ptm-cl"
    subnet: str = "10.78.0"
    dir: Path = Path("/tmp/ptm-cluster")

    def address(self, host: int) -> str:
        """Host ``host``'s (0-based) address on the switch."""
        return f"{self.subnet}.{host + 1}"

    def namespace(self, host: int) -> str:
        return f"{self.prefix}{host + 1}"

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(self.namespace(i) for i in range(self.hosts))


class EmulatedCluster:
    """``with EmulatedCluster(spec) as cluster:`` the hosts are up inside and gone afterwards, also when the
    body raises or the process is interrupted."""

    def __init__(self, spec: ClusterSpec, shaping: Shaping = Shaping(), keep_up: bool = False):
        self.spec = spec
        self.keep_up = keep_up
        self.delays_applied = True
        self._shaping = shaping

    def __enter__(self) -> EmulatedCluster:
        if os.geteuid() != 0:
            raise ClusterError(f"the emulated cluster needs root: {SCRIPT.name} creates network namespaces; "
                               "run as root")
        try:
            self._script("up", self._shaping)
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if not self.keep_up:
            self.down()

    def shape(self, shaping: Shaping) -> None:
        """Replace the links' shaping (the hosts stay up, their counters keep counting)."""
        self._script("shape", shaping)

    def down(self) -> None:
        self._script("down", Shaping())

    def _script(self, command: str, shaping: Shaping) -> None:
        s = self.spec
        env = {**os.environ, "PTM_MN_DIR": str(s.dir), "PTM_MN_HOSTS": str(s.hosts),
               "PTM_MN_SLOTS": str(s.ranks_per_host), "PTM_MN_PREFIX": s.prefix, "PTM_MN_SUBNET": s.subnet,
               "PTM_MN_INTER_RATE": str(shaping.inter_rate_bps), "PTM_MN_INTER_DELAY": str(shaping.inter_delay_us),
               "PTM_MN_INTRA_RATE": str(shaping.intra_rate_bps), "PTM_MN_INTRA_DELAY": str(shaping.intra_delay_us),
               "PTM_MN_DELAY_MISSING": "ignore"}
        done = subprocess.run(["bash", str(SCRIPT), command], env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["(no output)"]
            raise ClusterError(f"{SCRIPT.relative_to(REPO)} {command} failed: {lines[-1]}")
        if command != "down":
            applied = dict(line.split("=", 1) for line in (s.dir / "shaping").read_text().split())
            self.delays_applied = applied["delay_applied"] == "1"
