"""Bytes the kernel counted on each emulated host's links: eth0 (to the other hosts) and lo (inside the host).

A byte between hosts leaves through the sender's eth0 once (tx) and arrives through the receiver's eth0
once (rx); a byte between two processes of one host passes its lo once (tx and rx both count it). So
inter-host bytes are the hosts' eth0 tx summed and intra-host bytes the hosts' lo tx summed. Both include
the TCP/IP and Ethernet headers (about 5% at full-size segments) and anything else the hosts sent then
(the rendezvous store's traffic, small).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass

FILES = ("eth0/statistics/tx_bytes", "eth0/statistics/rx_bytes", "lo/statistics/tx_bytes", "lo/statistics/rx_bytes")


@dataclass(frozen=True)
class HostBytes:
    eth0_tx: int
    eth0_rx: int
    lo_tx: int
    lo_rx: int

    def __sub__(self, other: HostBytes) -> HostBytes:
        return HostBytes(self.eth0_tx - other.eth0_tx, self.eth0_rx - other.eth0_rx, self.lo_tx - other.lo_tx,
                         self.lo_rx - other.lo_rx)


@dataclass(frozen=True)
class LinkBytes:
    hosts: tuple[HostBytes, ...]  # in host order

    @property
    def inter(self) -> int:
        """Bytes sent from one host to another (every host's eth0 tx)."""
        return sum(h.eth0_tx for h in self.hosts)

    @property
    def intra(self) -> int:
        """Bytes sent between processes of one host (every host's lo tx)."""
        return sum(h.lo_tx for h in self.hosts)

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(tuple(a - b for a, b in zip(self.hosts, other.hosts, strict=True)))


def read(namespaces: tuple[str, ...]) -> LinkBytes:
    """The counters now, from /sys/class/net inside each host's namespace."""
    hosts = []
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "exec", ns, "cat", *(f"/sys/class/net/{f}" for f in FILES)],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        hosts.append(HostBytes(*map(int, out.split())))
    return LinkBytes(tuple(hosts))
