"""The hardware a plan is for, and the speeds its step prediction uses: each figure from its flag, else from a
named profile (profiles.py), else from this machine, and only when this machine is the one planned for; the
origin of every figure is kept for the report (docs/planner.md#hardware-flags-profiles-and-this-machine)."""
from __future__ import annotations

import argparse
import dataclasses
import os

import psutil
import torch

from ptm_planner.measure import local_profile, local_speeds
from ptm_planner.non_state import GiB
from ptm_planner.plan import Hardware
from ptm_planner.profiles import ClusterProfile, get_profile
from ptm_planner.step_time import Speeds, measure_host_adam
from zero_cache.aio import nearest_existing_dir

DEFAULT_PROFILE = "h100"  # a --device cuda plan's speeds given no --profile and no known GPU here (said in the plan)


def detect_hardware(args: argparse.Namespace) -> Hardware:
    """The hardware planned for: each figure from its flag, else from --profile, else from this machine when it is
    the machine planned for (no profile, and its device is the one asked for). ``args.hardware_sources`` says which,
    for the report."""
    profile = get_profile(args.profile) if args.profile else None
    cuda_here = torch.cuda.is_available()
    sources: dict[str, str] = {}
    from_profile = f"profile {args.profile}"
    device = args.device or ("cuda" if profile is not None or cuda_here else "cpu")
    sources["device"] = "flag" if args.device else from_profile if profile is not None else "this machine"
    if device == "cpu" and profile is not None:
        raise ValueError(f"--profile {args.profile} is a GPU cluster; drop --device cpu (or --profile)")
    here = profile is None and (device == "cpu" or cuda_here)  # this machine is the one planned for
    detected = ["device"] if args.device is None and profile is None else []
    if device == "cpu":
        if args.device_memory_gib is not None:
            raise ValueError("--device-memory-gib is for --device cuda; on cpu the device tier is host memory "
                             "(give --host-memory-gib)")
        device_memory = 0
    elif args.device_memory_gib is not None:
        device_memory, sources["device_memory"] = int(args.device_memory_gib * GiB), "flag"
    elif profile is not None:
        device_memory, sources["device_memory"] = int(profile.accelerator.memory_gib * GiB), from_profile
    elif cuda_here:
        device_memory, sources["device_memory"] = torch.cuda.get_device_properties(0).total_memory, "this machine"
        detected.append("device_memory")
    else:
        raise ValueError("--device cuda on a machine without CUDA: give --profile NAME (--list-profiles) or "
                         "--device-memory-gib (memory per GPU)")
    missing = []

    def figure(name: str, flag: str, given, from_prof, local):
        if given is not None:
            sources[name] = "flag"
            return given
        if profile is not None:
            sources[name] = from_profile
            return from_prof
        if here:
            sources[name] = "this machine"
            detected.append(name)
            return local()
        missing.append(flag)
        return 0

    host = figure("host_memory", "--host-memory-gib",
                  None if args.host_memory_gib is None else int(args.host_memory_gib * GiB),
                  int(profile.host_memory_gib * GiB) if profile else 0, lambda: psutil.virtual_memory().available)
    nvme = figure("nvme_free", "--nvme-free-gib", None if args.nvme_free_gib is None else int(args.nvme_free_gib * GiB),
                  int(profile.nvme_free_gib * GiB) if profile else 0,
                  lambda: psutil.disk_usage(nearest_existing_dir(args.nvme_path)).free)
    if missing:
        raise ValueError(f"a plan for GPUs this machine does not have takes none of its figures from this machine: "
                         f"give --profile NAME (--list-profiles) or {' and '.join(missing)}")
    existing = args.nvme_path  # the path itself, else the ancestor it would be created under
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "" if existing == args.nvme_path else f" ({existing}, where it would be created)"
        raise ValueError(f"--nvme-path {args.nvme_path}{where} is a file; give a directory (created if missing)")
    if args.cpus is not None:
        cpus, sources["cpus"] = args.cpus, "flag"
    elif profile is not None:
        cpus, sources["cpus"] = profile.cpus, from_profile
    else:  # only the SSD tier's I/O threads follow it; said in the report
        cpus = os.cpu_count() or 1
        sources["cpus"] = "this machine" if here else "this machine's (give --cpus or --profile)"
    for name, value in (("--host-memory-gib", host), ("--nvme-free-gib", nvme)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0")
    if device == "cuda" and device_memory <= 0:
        raise ValueError("--device-memory-gib must be > 0")
    args.hardware_sources = sources
    return Hardware(device, device_memory, host, args.nvme_path, nvme, cpus, tuple(detected))


def local_gpu_profile() -> str | None:
    """The profile of the GPU this machine has (None: no CUDA here, or a GPU no profile describes)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    for key, profile in (("H200", "h200"), ("H100", "h100")):
        if key in name:
            return profile
    if "A100" in name:
        return "a100-80g-hdr" if torch.cuda.get_device_properties(0).total_memory > 50 * GiB else "a100-40g-hdr"
    return None


def cluster_from_args(args: argparse.Namespace, hardware: Hardware) -> tuple[ClusterProfile, Speeds] | None:
    """The step model's cluster and the offload lanes' speeds: a CPU plan's measured here with --measure (else
    None); a GPU plan's from --profile (else the GPU here, else DEFAULT_PROFILE; the plan says which), each figure
    overridden by its flag. --device-tflops is the large-GEMM rate (the profile's peak x its GEMM share)."""
    if hardware.device != "cuda":
        if not args.measure:
            return None
        threads = max(1, hardware.cpus // args.nproc_per_node)
        profile = local_profile(args.nproc_per_node, threads, args.nvme_path)
        for key in ("device_tflops", "pcie_gbps", "device_adam_elems_per_s", "ssd_gbps", "host_adam_elems_per_s"):
            args.hardware_sources[key] = "measured here"
        return profile, local_speeds(profile)
    if args.measure:
        raise ValueError("--measure measures this machine's CPU ranks; for GPUs give --profile NAME (--list-profiles)")
    name = args.profile or local_gpu_profile() or DEFAULT_PROFILE
    profile = get_profile(name)
    sources = args.hardware_sources
    measured = []
    if args.host_adam_elems_per_s == "measure":
        host = measure_host_adam()
        measured.append("host_adam_elems_per_s")
    elif args.host_adam_elems_per_s is None:
        host = profile.host_adam_elems_per_s
    else:
        try:
            host = float(args.host_adam_elems_per_s)
        except ValueError:
            raise ValueError(f"--host-adam-elems-per-s takes a number or 'measure', got "
                             f"{args.host_adam_elems_per_s!r}") from None
    acc = profile.accelerator
    given = {"device_tflops": args.device_tflops, "pcie_gbps": args.pcie_gbps,
             "device_adam_elems_per_s": args.device_adam_elems_per_s, "ssd_gbps": args.ssd_gbps,
             "gradient_accumulation_steps": args.gradient_accumulation_steps,
             "host_adam_elems_per_s": host if args.host_adam_elems_per_s is not None else None}
    for flag, value in given.items():
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 (got {value})")
    origin = f"profile {name}" if args.profile else f"profile {name}, matched to this machine's GPU (give --profile)" \
        if name == local_gpu_profile() else f"default profile {name} (give --profile)"
    for key in ("device_tflops", "pcie_gbps", "device_adam_elems_per_s", "ssd_gbps", "host_adam_elems_per_s"):
        sources[key] = "measured here" if key in measured else "flag" if given[key] is not None else origin
    if args.device_tflops is not None:
        acc = dataclasses.replace(acc, gemm_efficiency=args.device_tflops / acc.peak_tflops)
    profile = dataclasses.replace(profile, accelerator=acc, pcie_gbps=args.pcie_gbps or profile.pcie_gbps,
                                  host_adam_elems_per_s=host)
    speeds = Speeds(device_tflops=acc.peak_tflops * acc.gemm_efficiency, pcie_gbps=profile.pcie_gbps,
                    device_adam_elems_per_s=args.device_adam_elems_per_s or profile.device_adam_elems_per_s,
                    host_adam_elems_per_s=host,
                    ssd_gbps=args.ssd_gbps or profile.nvme_gbps / profile.gpus_per_node, measured=tuple(measured))
    return profile, speeds
