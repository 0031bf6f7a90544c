"""Predicted time of one training step on an accelerator, from stated or measured speeds, and the
``prefetch_cache_sub_group_rate`` at which the optimizer's device and host parts finish together.

The engine overlaps (docs/zero_cache/design.md#copies-streams-and-the-host-lane): parameter copies to the
device and gradient copies to the host run on their own streams beside the forward and backward, so that
part of the step takes the longer of compute and each direction's copies. The optimizer step runs the
device's sub-groups (its fused Adam) beside the host lane, which updates the host sub-groups, streams the
SSD ones (update or I/O, whichever is slower, pipelined) and copies the updated parameters back to the
device; the step's optimizer part takes the longer of the two lanes. Moving sub-groups to the device
(a higher rate) shortens the host lane and lengthens the device's, so the best rate balances them unless
device memory caps it first.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Speeds:
    """What the prediction assumes; the defaults are stated figures for one H100/H200-class GPU on PCIe 5."""
    device_tflops: float = 400.0  # sustained model TFLOP/s of one accelerator
    pcie_gbps: float = 25.0  # host <-> device GB/s, each direction
    device_adam_elems_per_s: float = 5e10  # fused Adam on the accelerator (memory bound)
    host_adam_elems_per_s: float = 1e9  # fused Adam on this process's host cores
    ssd_gbps: float = 3.0  # SSD GB/s of this process, reads and writes together
    measured: tuple[str, ...] = ()  # which of the above were measured here


def measure_host_adam(elements: int = 1 << 22, repeats: int = 5) -> float:
    """Elements per second of torch's fused AdamW on this machine's CPU (median of ``repeats`` updates)."""
    p, g, m, v = (torch.randn(elements) for _ in range(4))
    v.abs_()
    step = torch.zeros(())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
        times.append(time.perf_counter() - t0)
    return elements / statistics.median(times)


@dataclass(frozen=True)
class StepWork:
    """One rank's work in one step."""
    flops: float
    h2d_bytes: float  # parameter shards copied to the device for gathers
    d2h_bytes: float  # reduce-scatter results copied to host gradient shards
    writeback_bytes: float  # host-updated parameters copied back to device parameter shards
    device_elems: int  # optimizer sub-group elements by tier
    host_elems: int
    ssd_elems: int
    ssd_bytes: float  # SSD reads and writes of the optimizer step


@dataclass(frozen=True)
class StepBreakdown:
    compute_s: float
    h2d_s: float
    d2h_s: float
    device_adam_s: float
    host_adam_s: float  # host sub-groups
    ssd_adam_s: float  # SSD sub-groups' update on the host
    ssd_io_s: float
    writeback_s: float

    @property
    def forward_backward_s(self) -> float:
        """Compute, with each direction's copies on its own stream beside it."""
        return max(self.compute_s, self.h2d_s, self.d2h_s)

    @property
    def host_lane_s(self) -> float:
        return self.host_adam_s + max(self.ssd_adam_s, self.ssd_io_s) + self.writeback_s

    @property
    def optimizer_s(self) -> float:
        return max(self.device_adam_s, self.host_lane_s)

    @property
    def step_s(self) -> float:
        return self.forward_backward_s + self.optimizer_s

    def lines(self) -> list[str]:
        ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
        return [f"  forward + backward {ms(self.forward_backward_s)}: compute {ms(self.compute_s)}, beside it on "
                f"their own streams parameter copies to the device {ms(self.h2d_s)} and gradient copies to the "
                f"host {ms(self.d2h_s)}",
                f"  optimizer {ms(self.optimizer_s)}: device Adam {ms(self.device_adam_s)} beside the host lane "
                f"{ms(self.host_lane_s)} (host Adam {ms(self.host_adam_s)}, SSD sub-groups max(update "
                f"{ms(self.ssd_adam_s)}, I/O {ms(self.ssd_io_s)}), write-back to the device {ms(self.writeback_s)})",
                f"  step {ms(self.step_s)}"]


def predict(work: StepWork, speeds: Speeds) -> StepBreakdown:
    pcie = speeds.pcie_gbps * 1e9
    return StepBreakdown(
        compute_s=work.flops / (speeds.device_tflops * 1e12),
        h2d_s=work.h2d_bytes / pcie, d2h_s=work.d2h_bytes / pcie,
        device_adam_s=work.device_elems / speeds.device_adam_elems_per_s,
        host_adam_s=work.host_elems / speeds.host_adam_elems_per_s,
        ssd_adam_s=work.ssd_elems / speeds.host_adam_elems_per_s,
        ssd_io_s=work.ssd_bytes / (speeds.ssd_gbps * 1e9),
        writeback_s=work.writeback_bytes / pcie)


def balanced_rate(speeds: Speeds, writeback_bytes_per_elem: float) -> float:
    """The share r of sub-groups on the device at which the device's Adam (r x E elements) and the host's (the
    rest, each element also copied back to the device) take equal time: r = h / (h + d), h and d the seconds
    per element on the host and on the device."""
    d = 1.0 / speeds.device_adam_elems_per_s
    h = 1.0 / speeds.host_adam_elems_per_s + writeback_bytes_per_elem / (speeds.pcie_gbps * 1e9)
    return h / (h + d)
