"""Where every shard lives: one byte budget per tier (device, host, SSD) and the sub-group placement.

``chunk_layout`` is the single source of the placement rules (which states a chunk has and their tiers;
see builder.py); ``place_sub_groups`` uses it to put optimizer sub-groups in tiers:

- the first ``prefetch_cache_sub_group_rate`` share of sub-groups keeps its states on the device;
- with ``offload_optimizer.device = cpu`` the rest go to the host while the host budget holds (states
  already on the host, e.g. ``offload_param`` shards, included), and the sub-groups beyond it spill to SSD
  (page files under ``offload_optimizer.nvme_path``); the host budget also covers the SSD staging buffers
  (three sub-groups with ``pipeline_optimizer``, one without, plus the parameter read-ahead window when
  ``offload_param.device = nvme``);
- with ``offload_optimizer.device = nvme`` the rest go to SSD.

Budgets (``zero_optimization.memory_budget``, bytes, -1 = derived from the machine): device = 90% of free
accelerator memory (on a CPU-only machine the compute device is host memory, accounted separately: 45%
of available memory), host = 90% of available memory (45% without an accelerator), nvme = 95% of the
free space under nvme_path. A placement that cannot fit is one error naming the bytes and the budget.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import psutil
import torch

from .aio import round_up
from .config import ConfigError, ZeroCacheConfig
from .partition import ChunkPlan
from .store import DEVICE, HOST, NVME, TIERS


@dataclass(frozen=True)
class StateSpec:
    name: str  # param, full, master, grad, exp_avg, exp_avg_sq
    kind: str
    tier: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def chunk_layout(plan: ChunkPlan, opt_tier: str, cfg: ZeroCacheConfig, dtype: torch.dtype,
                 device: torch.device) -> list[StateSpec]:
    """Every persistent state of one chunk, with its tier, for a given optimizer tier."""
    fp32 = dtype == torch.float32
    on_ssd = opt_tier == NVME
    cpu_compute = device.type == "cpu"
    if plan.resident:
        specs = [StateSpec("full", "params", DEVICE, plan.padded, dtype)]
        param_tier, param_on_cpu = DEVICE, cpu_compute
    else:
        offload = cfg.zero_optimization.offload_param.device
        if fp32 and (not on_ssd or offload == "nvme"):
            param_tier = opt_tier
        else:
            param_tier = {"cpu": HOST, "nvme": NVME}.get(offload, DEVICE)
        specs = [StateSpec("param", "params", param_tier, plan.shard, dtype)]
        param_on_cpu = param_tier in (HOST, NVME) or cpu_compute
    lock_free = cfg.zero_optimization.lock_free_update
    if lock_free or not (fp32 and (param_tier == opt_tier or (on_ssd and param_on_cpu))):
        specs.append(StateSpec("master", "optimizer", opt_tier, plan.shard, torch.float32))  # else param = master
    grad_tier = HOST if on_ssd else opt_tier
    specs.append(StateSpec("grad", "grads", grad_tier, plan.shard, torch.float32))
    if lock_free:  # the next step's gradients, and the updated parameters waiting to be published
        specs.append(StateSpec("grad_spare", "grads", grad_tier, plan.shard, torch.float32))
        specs.append(StateSpec("pending", "params", HOST if opt_tier != DEVICE else DEVICE, plan.shard, dtype))
    specs.append(StateSpec("exp_avg", "optimizer", opt_tier, plan.shard, torch.float32))
    specs.append(StateSpec("exp_avg_sq", "optimizer", opt_tier, plan.shard, torch.float32))
    return specs


def machine_budgets(cfg: ZeroCacheConfig, device: torch.device) -> dict[str, int]:
    """The configured budgets, with -1 replaced by the machine-derived defaults."""
    b = cfg.zero_optimization.memory_budget
    available = psutil.virtual_memory().available
    accel = device.type == "cuda" and torch.cuda.is_available()
    out = {}
    if b.device >= 0:
        out[DEVICE] = b.device
    elif accel:
        out[DEVICE] = int(0.9 * torch.cuda.mem_get_info(device)[0])
    else:
        out[DEVICE] = int(0.45 * available)
    out[HOST] = b.host if b.host >= 0 else int((0.9 if accel else 0.45) * available)
    if b.nvme >= 0:
        out[NVME] = b.nvme
    else:
        path = cfg.zero_optimization.offload_optimizer.nvme_path
        while path and not os.path.isdir(path):  # the swap directory is created later; use its nearest parent
            path = os.path.dirname(path.rstrip("/")) if path not in ("/", "") else ""
        out[NVME] = int(0.95 * psutil.disk_usage(path or "/").free)
    return out


def staging_bytes(layouts: list[list[StateSpec]], sub_groups: list[list[int]], pipeline: bool) -> int:
    """Host staging buffers the SSD tier needs at most: the largest run of in-flight swapped sub-groups."""
    sizes = [sum(round_up(s.nbytes) for i in sg for s in layouts[i] if s.tier == NVME) for sg in sub_groups]
    sizes = [x for x in sizes if x]
    window = 3 if pipeline else 1
    return max((sum(sizes[k:k + window]) for k in range(len(sizes))), default=0)


def param_staging_bytes(plans: list[ChunkPlan], layouts: list[list[StateSpec]], cfg: ZeroCacheConfig) -> int:
    """Host staging for parameter shards on SSD: the gather window ahead and the SSD read-ahead window
    (``stage3_prefetch_bucket_size`` gathered elements each, i.e. that over N shard elements) plus the two
    largest shards in use."""
    specs = [s for layout in layouts for s in layout if s.name == "param" and s.tier == NVME]
    if not specs:
        return 0
    shards = sorted((round_up(s.nbytes) for s in specs), reverse=True)
    dp = max(1, plans[0].padded // max(1, plans[0].shard))
    elem = specs[0].nbytes // max(1, specs[0].numel)
    window = 2 * cfg.zero_optimization.stage3_prefetch_bucket_size // dp * elem
    return min(sum(shards), window + sum(shards[:2]))


def tier_bytes(layouts: list[list[StateSpec]]) -> dict[str, int]:
    out = dict.fromkeys(TIERS, 0)
    for layout in layouts:
        for s in layout:
            out[s.tier] += s.nbytes
    return out


def place_sub_groups(plans: list[ChunkPlan], sub_groups: list[list[int]], cfg: ZeroCacheConfig,
                     dtype: torch.dtype, device: torch.device, budgets: dict[str, int]) -> tuple[list[str], int]:
    """Optimizer tier of every chunk, and the host bytes reserved for SSD staging buffers (optimizer
    sub-groups and parameter read-ahead)."""
    z = cfg.zero_optimization
    n = len(sub_groups)
    base = [DEVICE] * n
    if z.offload_optimizer.device != "none":
        cached = math.ceil(z.prefetch_cache_sub_group_rate * n)
        away = HOST if z.offload_optimizer.device == "cpu" else NVME
        base = [DEVICE if k < cached else away for k in range(n)]

    def layout_for(sg_tiers: list[str]):
        tiers = [DEVICE] * len(plans)
        for k, sg in enumerate(sub_groups):
            for i in sg:
                tiers[i] = sg_tiers[k]
        layouts = [chunk_layout(p, tiers[p.index], cfg, dtype, device) for p in plans]
        return tiers, layouts, (staging_bytes(layouts, sub_groups, z.pipeline_optimizer)
                                + param_staging_bytes(plans, layouts, cfg))

    tiers, layouts, staging = layout_for(base)
    used = tier_bytes(layouts)
    if used[HOST] + staging > budgets[HOST] and HOST in base:
        # Spill the last host sub-groups to SSD, one at a time, until the host budget holds.
        sg_tiers = list(base)
        for k in reversed(range(n)):
            if sg_tiers[k] != HOST:
                continue
            sg_tiers[k] = NVME
            tiers, layouts, staging = layout_for(sg_tiers)
            used = tier_bytes(layouts)
            if used[HOST] + staging <= budgets[HOST]:
                break
    needs = {DEVICE: used[DEVICE], HOST: used[HOST] + staging, NVME: used[NVME]}
    fixes = {DEVICE: "lower prefetch_cache_sub_group_rate or raise zero_optimization.memory_budget.device",
             HOST: "raise zero_optimization.memory_budget.host, use offload_optimizer.device = 'nvme' or lower "
                   "sub_group_size (smaller staging buffers)",
             NVME: "free disk space under nvme_path or raise zero_optimization.memory_budget.nvme"}
    for tier, need in needs.items():
        if need > budgets[tier]:
            raise ConfigError(f"zero_cache: model states need {need} bytes on the {tier} tier but its budget is "
                              f"{budgets[tier]} bytes; {fixes[tier]}")
    return tiers, staging
