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


PROFILES: dict[str, ClusterProfile] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense (1,979 with sparsity); NVLink 4: 900 GB/s per GPU,
    # both directions together (18 links x 50 GB/s), so 450 GB/s each way. NVIDIA DGX H100 user guide:
    # 8 ConnectX-7 400 Gb/s InfiniBand NDR ports per node for the compute fabric, one per GPU. Latency:
    # about 1 us through NVSwitch, about 3 us end to end over InfiniBand (1-5 us across published figures).
    "h100": ClusterProfile(
        name="h100", summary="8x H100 SXM per node, NVLink 4, 400 Gb/s InfiniBand per GPU",
        gpu_flops=989e12, gpus_per_node=8, intra_bits_per_s=450 * GBYTE * 8, inter_bits_per_s=400 * GBIT,
        intra_latency_s=1e-6, inter_latency_s=3e-6),
    # NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense; NVLink 3: 600 GB/s per GPU both ways, 300 GB/s each
    # way. Ethernet-class nodes such as Google Cloud's a2-highgpu-8g (8x A100 40GB) have 100 Gb/s per node,
    # 12.5 Gb/s per GPU; about 10 us end to end over RoCE.
    "a100-eth": ClusterProfile(
        name="a100-eth", summary="8x A100-40G per node, NVLink 3, 100 Gb/s Ethernet (RoCE) per node",
        gpu_flops=312e12, gpus_per_node=8, intra_bits_per_s=300 * GBYTE * 8, inter_bits_per_s=100 * GBIT / 8,
        intra_latency_s=1e-6, inter_latency_s=10e-6),
}


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
