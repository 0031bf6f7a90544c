"""Named hardware profiles: the GPUs and clusters users train on, from published figures, for the step-time
model (step_model.py) and the memory plan (plan.Hardware).

A profile is one node type and the network between such nodes. Every number is per GPU and per direction
unless its name says otherwise, and each profile names where its figures come from. The planner takes a
hardware number from the flag that gives it, else from the named profile, else (only with no profile) from the
machine it runs on, and its report says which (``ptm-plan --profile NAME``; ``--list-profiles``).

Three numbers are not datasheet figures: the share of peak FLOP/s a GPU reaches on large GEMMs, the share of
memory bandwidth its elementwise kernels reach, and the fixed cost of one GEMM call (what small GEMMs do not
amortise). The A100's two shares were calibrated on three rows of Narayanan et al., SC 2021, Table 1
(benchmarks/planner_paper_table.py re-derives them and predicts the other seven rows); the H100's and H200's
large-GEMM share is what cuBLAS reaches on them (600-800 of 989 TFLOP/s), their memory share the default 0.8, and
all share a stated per-call cost.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_tflops: float  # dense bf16 / fp16 tensor-core peak
    memory_gib: float
    memory_gbps: float  # HBM bandwidth, GB/s
    gemm_efficiency: float  # share of peak on large GEMMs
    gemm_call_us: float  # fixed cost of one GEMM call: efficiency(F) = e / (1 + e * peak * call / F)
    flash_efficiency: float  # share of peak of a flash-attention kernel (causal half skipped)
    memory_efficiency: float = 0.8  # share of memory_gbps an elementwise kernel reaches


@dataclass(frozen=True)
class Link:
    gbps: float  # GB/s per GPU, one direction
    latency_us: float  # per message, end to end


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    summary: str
    accelerator: Accelerator
    gpus_per_node: int
    intra: Link  # GPU to GPU inside a node (NVLink through NVSwitch)
    inter: Link  # one GPU's share of its node's network
    pcie_gbps: float  # host <-> GPU, per GPU, one direction
    host_memory_gib: float  # per node
    cpus: int  # per node
    host_adam_elems_per_s: float  # fused Adam on the host cores one GPU's process gets
    nvme_gbps: float  # per node, reads and writes together
    nvme_free_gib: float  # per node
    source: str
    # Collectives run beside the compute (NCCL on streams of their own); False where they take the cores the
    # compute uses (ranks of a CPU machine), so nothing hides under it.
    overlaps_comm: bool = True
    # The step-time model's validated error on this kind of profile (docs/planner.md#validation): the held-out rows of
    # a published A100 table for the named GPU clusters, the measured-here table for a measured CPU profile.
    expected_error: float = 0.08

    @property
    def device_adam_elems_per_s(self) -> float:
        """Adam is memory bound: per element it reads the fp32 master, gradient and two moments and writes the
        master, the moments and the 16-bit parameter (about 30 bytes)."""
        a = self.accelerator
        return a.memory_gbps * GB * a.memory_efficiency / ADAM_BYTES_PER_ELEMENT

    def with_nodes_of(self, gpus_per_node: int) -> ClusterProfile:
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)


ADAM_BYTES_PER_ELEMENT = 30
MEASURED_HERE_ERROR = 0.29  # benchmarks/planner_validation.py's largest error

# Datasheets: A100 SXM4 312 TFLOP/s bf16 dense, 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s;
# H100 SXM5 989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s; H200 SXM 989 TFLOP/s, 141 GB HBM3e at 4.8 TB/s.
# gemm_efficiency / memory_efficiency of the A100: calibrated (module docstring); gemm_call_us: a launch and
# the last wave of a GEMM, stated, not fitted (Table 1's GEMMs are too large to tell); flash attention reaches about
# 0.5-0.6 of peak in its authors' A100 and H100 figures (FlashAttention-2, Dao 2023).
A100_40G = Accelerator("A100-SXM4-40GB", 312.0, 40.0, 1555.0, gemm_efficiency=0.74, gemm_call_us=30.0,
                       flash_efficiency=0.55, memory_efficiency=0.95)
A100_80G = dataclasses.replace(A100_40G, name="A100-SXM4-80GB", memory_gib=80.0, memory_gbps=2039.0)
H100 = Accelerator("H100-SXM5-80GB", 989.0, 80.0, 3350.0, gemm_efficiency=0.72, gemm_call_us=30.0,
                   flash_efficiency=0.5)
H200 = dataclasses.replace(H100, name="H200-SXM-141GB", memory_gib=141.0, memory_gbps=4800.0)

# NVLink 3: 600 GB/s per GPU both ways (300 each way); NVLink 4: 900 (450). DGX A100: 8 HDR 200 Gb/s
# InfiniBand ports for the compute fabric (one per GPU), 2 x 64-core EPYC, 1 TB (320 GB system) or 2 TB host
# memory, 15 / 30 TB NVMe. DGX H100 / H200: 8 ConnectX-7 400 Gb/s NDR ports, 2 x 56-core Xeon 8480C, 2 TB,
# 30 TB NVMe. Cloud A100 nodes with Ethernet (Google Cloud a2-highgpu-8g): 100 Gb/s per node, 96 vCPUs,
# 680 GB. Latencies: about 1 us through NVSwitch, 3-5 us over InfiniBand, about 10 us over RoCE Ethernet.
# PCIe 4 x16 moves about 25 GB/s each way in practice, PCIe 5 about 50. Host Adam per process: the fused
# CPU Adam of a node's cores split over its 8 processes, about 1e9 elements/s each on DGX-class CPUs.
_DGX_A100 = dict(gpus_per_node=8, intra=Link(300.0, 1.0), inter=Link(25.0, 5.0), pcie_gbps=25.0,
                 host_memory_gib=1024.0, cpus=128, host_adam_elems_per_s=1e9, nvme_gbps=25.0, nvme_free_gib=14000.0)
_DGX_H100 = dict(gpus_per_node=8, intra=Link(450.0, 1.0), inter=Link(50.0, 3.0), pcie_gbps=50.0,
                 host_memory_gib=2048.0, cpus=112, host_adam_elems_per_s=1e9, nvme_gbps=50.0, nvme_free_gib=28000.0)

PROFILES: dict[str, ClusterProfile] = {p.name: p for p in (
    ClusterProfile("a100-40g-hdr", "DGX A100 (8x A100-SXM4-40GB, NVLink 3, 8x 200 Gb/s HDR InfiniBand per node)",
                   A100_40G, **_DGX_A100, source="NVIDIA A100 and DGX A100 datasheets (Selene, SC 2021's cluster)"),
    ClusterProfile("a100-80g-hdr", "DGX A100 (8x A100-SXM4-80GB, NVLink 3, 8x 200 Gb/s HDR InfiniBand per node)",
                   A100_80G, **{**_DGX_A100, "host_memory_gib": 2048.0, "nvme_free_gib": 28000.0},
                   source="NVIDIA A100 80GB and DGX A100 datasheets"),
    ClusterProfile("a100-eth", "8x A100-SXM4-40GB per node, NVLink 3, 100 Gb/s Ethernet (RoCE) per node",
                   A100_40G, gpus_per_node=8, intra=Link(300.0, 1.0), inter=Link(100 / 8 / 8, 10.0),
                   pcie_gbps=25.0, host_memory_gib=680.0, cpus=96, host_adam_elems_per_s=1e9, nvme_gbps=9.0,
                   nvme_free_gib=3000.0, source="NVIDIA A100 datasheet; Google Cloud a2-highgpu-8g"),
    ClusterProfile("h100", "DGX H100 (8x H100-SXM5-80GB, NVLink 4, 8x 400 Gb/s NDR InfiniBand per node)",
                   H100, **_DGX_H100, source="NVIDIA H100 and DGX H100 datasheets"),
    ClusterProfile("h200", "DGX H200 (8x H200-SXM-141GB, NVLink 4, 8x 400 Gb/s NDR InfiniBand per node)",
                   H200, **_DGX_H100, source="NVIDIA H200 and DGX H200 datasheets"),
)}


def get_profile(name: str) -> ClusterProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"--profile {name}: unknown; known: {', '.join(PROFILES)} (--list-profiles shows them)") \
            from None


def table() -> str:
    """The profiles, one line each (``ptm-plan --list-profiles``)."""
    lines = []
    for p in PROFILES.values():
        a = p.accelerator
        lines.append(f"{p.name:14s} {p.summary}: {a.peak_tflops:g} TFLOP/s bf16, {a.memory_gib:g} GiB at "
                     f"{a.memory_gbps:g} GB/s; NVLink {p.intra.gbps:g} GB/s, network {p.inter.gbps:g} GB/s per GPU "
                     f"({p.inter.latency_us:g} us); PCIe {p.pcie_gbps:g} GB/s; host {p.host_memory_gib:g} GiB, "
                     f"{p.cpus} cores, NVMe {p.nvme_gbps:g} GB/s per node. Source: {p.source}")
    return "\n".join(lines)
