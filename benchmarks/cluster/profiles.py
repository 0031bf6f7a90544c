"""Real GPU clusters, and the link rates and delays that give this machine the same compute : link ratio.

A rank here stands for one GPU of the named cluster. This machine computes ``ratio`` = (its fp32 matmul
FLOP/s per rank, measured with every rank of the job running at once) / (the GPU's dense bf16 FLOP/s) times
as fast as the GPU, so its links get ``ratio`` times the real bandwidth: a step's compute time and its
transfer time then both stretch by 1/ratio and keep the real cluster's proportion. Time as a whole dilates by
1/ratio, so a latency becomes latency / ratio; that is usually far beyond what a training step can afford
(seconds per message), so it is clamped to ``max_delay_s`` and the clamp is reported.
"""
from __future__ import annotations

from dataclasses import dataclass

from ptm_planner import profiles as planner_profiles

GBIT = 1e9
GBYTE = 1e9


@dataclass(frozen=True)
class ClusterProfile:
    """One real cluster, per GPU and per direction."""
    name: str
    summary: str
    gpu_flops: float  # dense bf16 matmul FLOP/s of one GPU
    gpus_per_node: int
    intra_bits_per_s: float  # GPU to GPU inside a node (NVLink), one direction
    inter_bits_per_s: float  # one GPU's share of its node's network, one direction
    intra_latency_s: float
    inter_latency_s: float


def _from_planner(name: str) -> ClusterProfile:
    """The planner's profile of that name (ptm_planner/profiles.py, where the figures and their sources live)."""
    p = planner_profiles.PROFILES[name]
    return ClusterProfile(name=name, summary=p.summary, gpu_flops=p.accelerator.peak_tflops * 1e12,
                          gpus_per_node=p.gpus_per_node, intra_bits_per_s=p.intra.gbps * GBYTE * 8,
                          inter_bits_per_s=p.inter.gbps * GBYTE * 8, intra_latency_s=p.intra.latency_us * 1e-6,
                          inter_latency_s=p.inter.latency_us * 1e-6)


# DGX H100 (400 Gb/s InfiniBand per GPU) and an Ethernet-class A100 node (100 Gb/s per node of 8).
PROFILES: dict[str, ClusterProfile] = {name: _from_planner(name) for name in ("h100", "a100-eth")}


@dataclass(frozen=True)
class EmulatedLinks:
    """The shaping of one emulated host (R ranks), per direction, and how it was derived."""
    profile: ClusterProfile
    local_flops_per_rank: float
    ranks_per_host: int
    ratio: float  # local FLOP/s per rank / GPU FLOP/s
    inter_rate_bps: int  # the host's link to the switch: R GPUs' share of the node's network, scaled
    intra_rate_bps: int  # the host's lo: R GPUs' NVLink, scaled (lo carries every byte between them once)
    inter_delay_s: float  # latency / ratio: what time dilation asks for
    intra_delay_s: float
    max_delay_s: float

    @property
    def inter_delay_applied_s(self) -> float:
        return min(self.inter_delay_s, self.max_delay_s)

    @property
    def intra_delay_applied_s(self) -> float:
        return min(self.intra_delay_s, self.max_delay_s)

    def line(self, delays_in_force: bool = True) -> str:
        """The derivation in one line, as every run prints it. ``delays_in_force``: False where the kernel
        could not apply the delays (no netem qdisc)."""
        p, r = self.profile, self.ranks_per_host
        delays = (f"delay inter {_dur(self.inter_delay_s)}, intra {_dur(self.intra_delay_s)} (latency / ratio)"
                  f", clamped to {_dur(self.max_delay_s)}: inter {_dur(self.inter_delay_applied_s)}, intra "
                  f"{_dur(self.intra_delay_applied_s)}")
        if not delays_in_force:
            delays += " -- not applied: this kernel has no netem qdisc, so only the rates are emulated"
        return (f"derivation: profile {p.name} ({p.summary}; {p.gpu_flops / 1e12:.0f} TFLOP/s per GPU) | this "
                f"machine {self.local_flops_per_rank / 1e9:.2f} GFLOP/s fp32 matmul per rank | ratio "
                f"{self.ratio:.3g} | inter-host per GPU {_rate(p.inter_bits_per_s)} x ratio x {r} ranks = "
                f"{_rate(self.inter_rate_bps)} per host and direction | intra-host per GPU "
                f"{_rate(p.intra_bits_per_s)} x ratio x {r} ranks = {_rate(self.intra_rate_bps)} on each host's lo"
                f" | {delays}")


def derive(profile: ClusterProfile, local_flops_per_rank: float, ranks_per_host: int,
           max_delay_s: float = 5e-3) -> EmulatedLinks:
    """Link rates and delays that give this machine the profile's compute : link proportion."""
    if local_flops_per_rank <= 0:
        raise ValueError(f"local FLOP/s per rank must be positive, got {local_flops_per_rank}")
    if ranks_per_host < 1:
        raise ValueError(f"ranks per host must be at least 1, got {ranks_per_host}")
    ratio = local_flops_per_rank / profile.gpu_flops
    return EmulatedLinks(
        profile=profile, local_flops_per_rank=local_flops_per_rank, ranks_per_host=ranks_per_host, ratio=ratio,
        inter_rate_bps=max(1, round(profile.inter_bits_per_s * ratio * ranks_per_host)),
        intra_rate_bps=max(1, round(profile.intra_bits_per_s * ratio * ranks_per_host)),
        inter_delay_s=profile.inter_latency_s / ratio, intra_delay_s=profile.intra_latency_s / ratio,
        max_delay_s=max_delay_s)


def _rate(bps: float) -> str:
    for unit, scale in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} b/s"


def _dur(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
