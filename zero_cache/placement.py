"""Where every shard lives: one byte budget per tier (device, host, SSD) and the sub-group placement.

``chunk_layout`` is the single source of the placement rules (which states a chunk has and their tiers;
see chunk_init.py); ``place_states`` uses it to put optimizer sub-groups in tiers:

- the first ``prefetch_cache_sub_group_rate`` share of sub-groups keeps its states on the device;
- with ``offload_optimizer.device = cpu`` the rest go to the host while the host budget holds (states
  already on the host, e.g. ``offload_param`` shards, included), and the sub-groups beyond it spill to SSD
  (page files under ``offload_optimizer.nvme_path``); the host budget also covers the SSD staging buffers
  (three sub-groups with ``pipeline_optimizer``, one without, plus the parameter read-ahead window when
  ``offload_param.device = nvme``);
- with ``offload_optimizer.device = nvme`` the rest go to SSD;
- if the host still cannot hold the gradient shards of the SSD sub-groups, those become page files too.

Budgets (``zero_optimization.memory_budget``, bytes, -1 = derived from the machine, split evenly between
the ranks of this node, ``LOCAL_WORLD_SIZE``): device = 90% of free accelerator memory (on a CPU-only
machine the compute device is host memory, accounted separately: 45% of available memory), host = 90% of
available memory (45% without an accelerator), nvme = 95% of the free space under nvme_path. A placement
that cannot fit is one error naming the bytes and the budget.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import psutil
import torch

from .aio import check_writable, nearest_existing_dir, round_up
from .config import ZeroCacheConfig, ZeroConfigError
from .partition import ChunkPlan
from .states import State
from .store import DEVICE, HOST, NVME, TIERS
from .streams import STAGING_BUFFERS, separate_memory


@dataclass(frozen=True)
class StateSpec:
    state: State
    kind: str
    tier: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def chunk_layout(plan: ChunkPlan, opt_tier: str, cfg: ZeroCacheConfig, dtype: torch.dtype,
                 device: torch.device, grad_on_ssd: bool = False) -> list[StateSpec]:
    """Every persistent state of one chunk, with its tier, for a given optimizer tier (``grad_on_ssd``: the
    gradient shard of an SSD sub-group is a page file too, see grad_reducer.py)."""
    fp32 = dtype == torch.float32
    on_ssd = opt_tier == NVME
    cpu_compute = not separate_memory(cfg, device)  # the host optimizer may update device-tier tensors in place
    if plan.resident:
        specs = [StateSpec(State.FULL, "params", DEVICE, plan.padded, dtype)]
        param_tier, param_on_cpu = DEVICE, cpu_compute
    else:
        offload = cfg.zero_optimization.offload_param.device
        if fp32 and (not on_ssd or offload == "nvme"):
            param_tier = opt_tier
        else:
            param_tier = {"cpu": HOST, "nvme": NVME}.get(offload, DEVICE)
        specs = [StateSpec(State.PARAM, "params", param_tier, plan.shard, dtype)]
        param_on_cpu = param_tier in (HOST, NVME) or cpu_compute
    lock_free = cfg.zero_optimization.lock_free_update
    if lock_free or not (fp32 and (param_tier == opt_tier or (on_ssd and param_on_cpu))):
        specs.append(StateSpec(State.MASTER, "optimizer", opt_tier, plan.shard, torch.float32))  # else param = master
    grad_tier = (NVME if grad_on_ssd else HOST) if on_ssd else opt_tier
    specs.append(StateSpec(State.GRAD, "grads", grad_tier, plan.shard, torch.float32))
    if lock_free:  # the next step's gradients, and the updated parameters waiting to be published
        specs.append(StateSpec(State.GRAD_SPARE, "grads", grad_tier, plan.shard, torch.float32))
        specs.append(StateSpec(State.PENDING, "params", HOST if opt_tier != DEVICE else DEVICE, plan.shard, dtype))
    specs.append(StateSpec(State.EXP_AVG, "optimizer", opt_tier, plan.shard, torch.float32))
    specs.append(StateSpec(State.EXP_AVG_SQ, "optimizer", opt_tier, plan.shard, torch.float32))
    return specs


def machine_budgets(cfg: ZeroCacheConfig, device: torch.device) -> dict[str, int]:
    """The configured budgets, with -1 replaced by the machine-derived defaults."""
    b = cfg.zero_optimization.memory_budget
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # ranks sharing this machine
    available = psutil.virtual_memory().available // local_ranks
    accel = device.type == "cuda" and torch.cuda.is_available()
    out = {}
    if b.device >= 0:
        out[DEVICE] = b.device
    elif accel:
        out[DEVICE] = int(0.9 * torch.cuda.mem_get_info(device)[0])
    else:
        out[DEVICE] = int(0.45 * available)
    out[HOST] = b.host if b.host >= 0 else int((0.9 if accel else 0.45) * available)
    z = cfg.zero_optimization
    ssd_path = next((o.nvme_path for o in (z.offload_optimizer, z.offload_param) if o.device == "nvme"), None)
    if ssd_path:  # an empty one is reported when the SSD tier opens it
        check_writable(ssd_path)
    if b.nvme >= 0:
        out[NVME] = b.nvme
    else:
        path = ssd_path or z.offload_optimizer.nvme_path
        out[NVME] = int(0.95 * psutil.disk_usage(nearest_existing_dir(path) if path else "/").free) // local_ranks
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
    specs = [s for layout in layouts for s in layout if s.state == State.PARAM and s.tier == NVME]
    if not specs:
        return 0
    shards = sorted((round_up(s.nbytes) for s in specs), reverse=True)
    dp = max(1, plans[0].padded // max(1, plans[0].shard))
    elem = specs[0].nbytes // max(1, specs[0].numel)
    window = 2 * cfg.zero_optimization.stage3_prefetch_bucket_size // dp * elem
    return min(sum(shards), window + sum(shards[:2]))


def copy_staging_units(plans: list[ChunkPlan], layouts: list[list[StateSpec]], cfg: ZeroCacheConfig,
                       device: torch.device) -> tuple[int, int]:
    """Bytes of one pinned staging buffer of host <-> device copies (streams.py) per direction, with an
    accelerator or the emulated one (0: none): the largest transfer staged that way. Host to device: a
    parameter shard in host memory or on SSD, or an fp32 master written back to a device parameter shard;
    device to host: an fp32 gradient shard in host memory or on SSD."""
    if not separate_memory(cfg, device):
        return 0, 0
    h2d = d2h = 0
    for plan, layout in zip(plans, layouts):
        tiers = {s.state: s for s in layout}
        param = tiers.get(State.PARAM)
        if param is not None and param.tier != DEVICE:
            h2d = max(h2d, param.nbytes)
        master = tiers.get(State.MASTER)
        on_device = plan.resident or (param is not None and param.tier == DEVICE)
        if master is not None and master.tier != DEVICE and on_device:
            h2d = max(h2d, master.nbytes)
        if tiers[State.GRAD].tier != DEVICE:
            d2h = max(d2h, 4 * plan.shard)
    return round_up(h2d) if h2d else 0, round_up(d2h) if d2h else 0


def copy_staging_bytes(plans: list[ChunkPlan], layouts: list[list[StateSpec]], cfg: ZeroCacheConfig,
                       device: torch.device) -> int:
    """Host bytes of the pinned staging pools: ``STAGING_BUFFERS`` buffers per direction."""
    h2d, d2h = copy_staging_units(plans, layouts, cfg, device)
    return STAGING_BUFFERS["h2d"] * h2d + STAGING_BUFFERS["d2h"] * d2h


def tier_bytes(layouts: list[list[StateSpec]]) -> dict[str, int]:
    out = dict.fromkeys(TIERS, 0)
    for layout in layouts:
        for s in layout:
            out[s.tier] += s.nbytes
    return out


@dataclass(frozen=True)
class Placement:
    opt_tiers: list[str]  # optimizer tier of every chunk
    grad_on_ssd: set[int]  # chunks whose gradient shard is an SSD page file
    layouts: list[list[StateSpec]]
    opt_staging: int  # host bytes reserved for the optimizer's (and gradients') SSD staging buffers
    param_staging: int  # host bytes reserved for parameter shards read from SSD for gathers (param_keep included)
    copy_staging: int = 0  # host bytes of the pinned staging pools of host <-> device copies
    param_keep: int = 0  # of param_staging: SSD parameter shards held in host memory between their uses

    @property
    def staging(self) -> int:
        return self.opt_staging + self.param_staging + self.copy_staging

    @property
    def tier_bytes(self) -> dict[str, int]:
        return tier_bytes(self.layouts)


def place_states(plans: list[ChunkPlan], sub_groups: list[list[int]], cfg: ZeroCacheConfig, dtype: torch.dtype,
                 device: torch.device, budgets: dict[str, int]) -> Placement:
    """Where every state of every chunk lives under the budgets, and the host bytes reserved for SSD staging
    buffers (optimizer sub-groups and parameter read-ahead).

    Beyond the host budget the last host sub-groups spill to SSD one at a time; if the host still does not
    hold the gradient shards of the SSD sub-groups (4 B/param/N), they become page files too, from the
    last sub-group backwards (not with lock_free_update, whose background step reads them)."""
    z = cfg.zero_optimization
    n = len(sub_groups)
    base = [DEVICE] * n
    if z.offload_optimizer.device != "none":
        cached = math.ceil(z.prefetch_cache_sub_group_rate * n)
        away = HOST if z.offload_optimizer.device == "cpu" else NVME
        base = [DEVICE if k < cached else away for k in range(n)]

    def layout_for(sg_tiers: list[str], grad_ssd_groups: set[int]) -> Placement:
        tiers = [DEVICE] * len(plans)
        grad_ssd = set()
        for k, sg in enumerate(sub_groups):
            for i in sg:
                tiers[i] = sg_tiers[k]
                if k in grad_ssd_groups and not plans[i].resident:
                    grad_ssd.add(i)
        layouts = [chunk_layout(p, tiers[p.index], cfg, dtype, device, p.index in grad_ssd) for p in plans]
        return Placement(tiers, grad_ssd, layouts, staging_bytes(layouts, sub_groups, z.pipeline_optimizer),
                         param_staging_bytes(plans, layouts, cfg), copy_staging_bytes(plans, layouts, cfg, device))

    def fits(pl: Placement) -> bool:
        return pl.tier_bytes[HOST] + pl.staging <= budgets[HOST]

    def fewest(candidates: list[int], place) -> Placement:
        """Move the last m candidates, for the smallest m that fits the host budget (bisection: host use
        falls as m grows); all of them when none fits."""
        lo, hi = 0, len(candidates)
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(place(candidates[len(candidates) - mid:])):
                hi = mid
            else:
                lo = mid + 1
        return place(candidates[len(candidates) - lo:])

    def spill(moved: list[int]) -> Placement:
        moved = set(moved)
        return layout_for([NVME if k in moved else t for k, t in enumerate(base)], set())

    placed = fewest([k for k in range(n) if base[k] == HOST], spill)
    if not fits(placed) and z.stage > 1 and not z.lock_free_update:
        sg_tiers = [placed.opt_tiers[sg[0]] for sg in sub_groups]
        placed = fewest([k for k in range(n) if sg_tiers[k] == NVME], lambda moved: layout_for(sg_tiers, set(moved)))
    used, staging = placed.tier_bytes, placed.staging
    needs = {DEVICE: used[DEVICE], HOST: used[HOST] + staging, NVME: used[NVME]}
    fixes = {DEVICE: "lower prefetch_cache_sub_group_rate or raise zero_optimization.memory_budget.device",
             HOST: "raise zero_optimization.memory_budget.host, use offload_optimizer.device = 'nvme' or lower "
                   "sub_group_size (smaller staging buffers)",
             NVME: "free disk space under nvme_path or raise zero_optimization.memory_budget.nvme"}
    for tier, need in needs.items():
        if need > budgets[tier]:
            raise ZeroConfigError(f"zero_cache: model states need {need} bytes on the {tier} tier but its budget is "
                              f"{budgets[tier]} bytes; {fixes[tier]}")
    placed = with_param_cache(placed, budgets[HOST] - needs[HOST])
    return with_read_ahead(placed, sub_groups, budgets[HOST] - needs[HOST] - placed.param_keep, z.pipeline_optimizer)


def with_param_cache(placed: Placement, spare_host: int) -> Placement:
    """Give host budget the states left unused to SSD parameter shards held between their uses, up to all of
    them: a shard read for the forward serves the backward's gather (coordinator.py), and stays as a clean
    copy for the optimizer, whose written shard serves the next forward (ssd_store.py). It comes before the
    optimizer's read-ahead because it saves reads, where read-ahead only moves them under compute."""
    shards = sum(round_up(s.nbytes) for layout in placed.layouts for s in layout
                 if s.state == State.PARAM and s.tier == NVME)
    keep = min(max(spare_host, 0), shards)
    return replace(placed, param_staging=placed.param_staging + keep, param_keep=keep) if keep else placed


def with_read_ahead(placed: Placement, sub_groups: list[list[int]], spare_host: int, pipeline: bool) -> Placement:
    """Give host budget the states left unused to the optimizer's staging pool, up to every SSD sub-group:
    the step reads that many sub-groups ahead, starting during the backward (optimizer.py). Not when
    gradient shards are SSD page files: their staging buffers, taken during the backward, share the pool."""
    if not pipeline or placed.grad_on_ssd or spare_host <= 0:
        return placed
    swapped = sum(round_up(s.nbytes) for sg in sub_groups for i in sg for s in placed.layouts[i] if s.tier == NVME)
    extra = min(spare_host, swapped - placed.opt_staging)
    return replace(placed, opt_staging=placed.opt_staging + extra) if extra > 0 else placed
