"""The memory planner's model: does a GPT fit this hardware under zero_cache ZeRO-3, where does every state
live, and which configuration is the fastest that fits (the command line is ptm_planner.cli).

The model states come from the engine's own code, not from formulas: the model is built on the meta
device (no memory) as the trainer builds it, posing as one rank of each distinct pipeline stage, and its
parameters go through ``zero_cache.partition.plan_chunks`` / ``plan_sub_groups`` and
``zero_cache.placement.place_states`` with the config and budgets the planner writes, so the bytes per
tier are what ``engine.memory_report()`` reports. Memory that is not model state is estimated
(non_state.py): gathered parameters, gradient reduce buffers, activations, the loss's logits and a
per-process runtime overhead. A mixture of experts plans the same way: its experts are a param group of
their own, sharded over the expert-data-parallel group (stages.py).

Choice: with a profile (every GPU plan; a CPU plan with --measure), every configuration below that fits is a
candidate and the one with the fewest predicted seconds per token wins (step_model.py; ``Planner.ranked``): per
offload mode, activation choice and layout, the first of the largest pages, sub-groups and kept-gathered arena
that fits. Without a profile, the first that fits in this order, fastest first by rule: offload none; optimizer
and parameters in host memory; the same with what the host cannot hold spilled to SSD; everything on SSD.
Within each: one transformer layer per chunk, then one matrix per chunk (less gathered memory); the requested
micro-batch, then full recompute, then halved micro-batches; the largest sub_group_size whose SSD staging fits;
on an accelerator, an arena that keeps every gathered chunk from the forward to the backward, then the one of
max_contigous_params_size (arena_numel); and the largest prefetch_cache_sub_group_rate (share of optimizer
sub-groups kept on the device) that fits. When a data-parallel group spans nodes (more than one member on each),
each choice of activations tries the layouts that send fewer bytes between nodes first (LAYOUTS): shard groups of
one node's ranks (MiCS, more state per rank), then secondary shards in the node (hpZ, a 1/node copy of the
gathered parameters), then flat.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron.core.transformer_config import TransformerConfig
from ptm_planner.activations import ActivationLayout
from ptm_planner.non_state import CPU_OVERHEAD, CUDA_OVERHEAD, GiB, NonState, RuntimeOverhead, non_state
from ptm_planner.profiles import ClusterProfile
from ptm_planner.stages import EXPERT_GROUP, Mesh, StageModel, build_stage, representative_stages
from ptm_planner.step_model import DataParallel, ModelShape, Parallel, StepPrediction, Workload
from ptm_planner.step_model import predict as predict_step
from ptm_planner.step_time import Speeds, StepBreakdown, StepWork, balanced_rate, predict
from zero_cache.aio import HEADER_BYTES, round_up
from zero_cache.config import ZeroCacheConfig, ZeroConfigError, parse_config
from zero_cache.param_arena import region_numel
from zero_cache.partition import ChunkPlan, plan_chunks, plan_sub_groups
from zero_cache.placement import place_states
from zero_cache.store import DEVICE, HOST, NVME, TIERS

# Shares of each resource a plan may fill: the engine's own defaults for its budgets
# (zero_cache.placement.machine_budgets): 90% of accelerator memory, 90% of host memory (split evenly
# between the processes of a node), 95% of the free disk under nvme_path.
DEVICE_SHARE, HOST_SHARE, NVME_SHARE = 0.9, 0.9, 0.95
DEFAULT_VOCAB_SIZE = 50257  # GPT-2's tokenizer
OFFLOADS = ("none", "cpu", "cpu+nvme", "nvme")  # fastest first
# sub_group_size candidates (shard elements), largest (fewest, biggest SSD transfers) first.
SUB_GROUP_SIZES = tuple(int(m * 10**e) for e in range(9, 2, -1) for m in (1, 0.5, 0.2))
RATE_STEPS = 100  # prefetch_cache_sub_group_rate is chosen in steps of 1/RATE_STEPS


@dataclass(frozen=True)
class Hardware:
    device: str  # "cpu" or "cuda"
    device_memory: int  # bytes per accelerator (cuda); on cpu the device tier is host memory
    host_memory: int  # bytes per node
    nvme_path: str
    nvme_free: int  # bytes free under nvme_path, per node
    cpus: int  # per node
    detected: tuple[str, ...] = ()  # which of the above were measured on this machine

    @property
    def overhead(self) -> RuntimeOverhead:
        return CUDA_OVERHEAD if self.device == "cuda" else CPU_OVERHEAD


@dataclass(frozen=True)
class Request:
    model: TransformerConfig  # precision = compute precision; recompute_granularity "full" = forced
    mesh: Mesh
    hardware: Hardware
    micro_batch_size: int  # requested; the plan may lower it
    offloads: tuple[str, ...] = OFFLOADS  # allowed offload modes, fastest first
    make_vocab_size_divisible_by: int = 128
    size_name: str | None = None
    speeds: Speeds | None = None  # with an accelerator: the offload lanes and the balanced rate (step_time.py)
    accumulation_steps: int = 1  # micro-batches per step, for the step prediction
    layout: ActivationLayout = ActivationLayout()  # sequence/context parallelism, interleaving, recompute, offload
    profile: ClusterProfile | None = None  # with an accelerator: the step-time model's cluster (step_model.py)
    snapshot_copies: int = 0  # in-memory snapshots held per rank: 1 its own, 2 with --replication's copy

    @property
    def dtype(self) -> torch.dtype:
        return self.model.params_dtype

    @property
    def recompute_forced(self) -> bool:
        return self.model.recompute_granularity == "full"

    @property
    def recompute_allowed(self) -> bool:
        """Full recompute, unless activations are offloaded (the trainer takes one or the other)."""
        return not self.layout.offloaded_layers


# ---- the zero_cache config ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One candidate configuration."""
    offload: str
    page: int  # allgather_bucket_size (elements per chunk); prefetch and live limits follow from it
    micro_batch_size: int
    recompute: bool
    sub_group_size: int
    rate: float = 0.0  # prefetch_cache_sub_group_rate
    # The arena holds every gathered chunk, so the forward's gathers serve the backward too (no second gather
    # or host-to-device copy of the parameters per micro-batch); tried first on an accelerator.
    keep_gathered: bool = False
    layout: str = "flat"  # across nodes (LAYOUTS): flat ZeRO-3, MiCS shard groups of a node, or hpZ secondary shards
    schedule: str = "1f1b"  # the pipeline schedule with one model chunk per stage (Planner.schedules)

    @property
    def max_live(self) -> int:
        return 3 * self.page  # the chunk in use, the one prefetched and one kept for reuse


# ZeRO-3 layouts across nodes, fewest inter-node bytes first (docs/zero_cache/hierarchical.md): "mics" shards over the
# data-parallel ranks of one node (its gathers stay inside it; only gradient shards cross), "hpz" keeps secondary
# shards in the node (the backward's gathers stay inside it), "flat" shards over the whole group.
LAYOUTS = ("mics", "hpz", "flat")


def persistence_threshold(model_cfg: TransformerConfig) -> int:
    """DeepSpeed's recommendation, 10 x hidden size: biases and norms stay whole on every rank."""
    return 10 * model_cfg.hidden_size


def arena_numel(partitioned: list[int], element_size: int, keep_gathered: bool = False) -> int:
    """max_contigous_params_size: room for what lives at once in the backward, the embedding's chunk (its gradient
    is complete only at the end, so it stays in use) beside the layer in use and the next one (two of the layers'
    chunks, the most common size); at least two of the largest chunks; all of them when they take less or are all
    kept gathered. (A 4-layer GPT whose embedding chunk is a third of a layer's ran out of room with two layers.)"""
    regions = [region_numel(n, element_size) for n in partitioned]
    if keep_gathered or not regions:
        return sum(regions)
    layer = max(Counter(regions).most_common(), key=lambda kv: (kv[1], kv[0]))[0]
    other = max((r for r in regions if r != layer), default=0)
    return min(max(2 * max(regions), other + 2 * layer), sum(regions))


def ds_config(request: Request, option: Option, arena: int, budgets: dict[str, int] | None) -> dict:
    """The DeepSpeed-style JSON for the trainer (batch sizes and optimizer come from the Megatron flags)."""
    hw = request.hardware
    cuda = hw.device == "cuda"
    zero = {
        "stage": 3,
        "allgather_bucket_size": option.page,
        "sub_group_size": option.sub_group_size,
        "stage3_prefetch_bucket_size": option.page,  # the next chunk is gathered while this one computes
        "stage3_max_live_parameters": option.max_live,
        "stage3_max_reuse_distance": option.page,
        "stage3_param_persistence_threshold": persistence_threshold(request.model),
        "pipeline_optimizer": True,
        "prefetch_cache_sub_group_rate": option.rate,
        "max_contigous_params_size": arena or -1,
        "max_param_reduce_events": 1,
        "is_communication_time_profiling": False,
        "save_large_model_multi_slice": True,
        # The host-memory estimates are measured with freed blocks returned (a run of 107 layers on the 24 GiB
        # test machine ran out of memory in its second step with the heap kept).
        "reuse_freed_host_memory": False,
    }
    node = request.mesh.node_shard_dp
    if option.layout == "mics":
        zero["mics_shard_size"] = node
    elif option.layout == "hpz":
        zero["zero_hpz_partition_size"] = node
    if option.offload != "none":  # "cpu+nvme": host memory, the sub-groups beyond the host budget on SSD
        device = "nvme" if option.offload == "nvme" else "cpu"
        for key in ("offload_optimizer", "offload_param"):
            zero[key] = {"device": device, "nvme_path": hw.nvme_path, "pin_memory": cuda}
    if budgets is not None:
        zero["memory_budget"] = dict(budgets)
    threads = max(1, min(4, hw.cpus // request.mesh.nproc_per_node))
    return {
        "bf16": {"enabled": request.dtype == torch.bfloat16},
        "fp16": {"enabled": request.dtype == torch.float16},
        "steps_per_print": 10,
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": threads},
    }


# ---- model states: the engine's placement code -------------------------------------------------------
@dataclass
class StateAccount:
    """Bytes of model state one rank allocates, per (kind, tier), as engine.memory_report() counts them."""
    by_kind_tier: dict[tuple[str, str], int]
    expert_by_tier: dict[str, int]  # of those, the states of the experts' chunks (ptm_planner.stages.EXPERT_GROUP)
    staging: int  # host bytes reserved for SSD staging buffers (optimizer pipeline + parameter reads)
    nvme_disk: int  # disk bytes of the page files (4 KiB header + payload rounded up to 4 KiB)
    opt_tiers: list[str]  # optimizer tier of every chunk
    sub_groups: int
    cached_sub_groups: int  # sub-groups whose optimizer states stay on the device

    @property
    def by_tier(self) -> dict[str, int]:
        out = dict.fromkeys(TIERS, 0)
        for (_, tier), n in self.by_kind_tier.items():
            out[tier] += n
        return out


def account_states(plans: list[ChunkPlan], sub_groups: list[list[int]], cfg: ZeroCacheConfig, dtype: torch.dtype,
                   device: torch.device, host_budget: int) -> StateAccount:
    """Place every shard as ZeroEngine.__init__ does (``place_states``); ``host_budget`` decides what spills
    to SSD. Raises zero_cache.ZeroConfigError when the host cannot hold what must stay there."""
    unlimited = sys.maxsize
    placed = place_states(plans, sub_groups, cfg, dtype, device,
                          {DEVICE: unlimited, HOST: host_budget, NVME: unlimited})
    by_kind_tier: dict[tuple[str, str], int] = {}
    experts = dict.fromkeys(TIERS, 0)
    disk = 0
    for plan, layout in zip(plans, placed.layouts):
        for s in layout:
            by_kind_tier[(s.kind, s.tier)] = by_kind_tier.get((s.kind, s.tier), 0) + s.nbytes
            if plan.group == EXPERT_GROUP:
                experts[s.tier] += s.nbytes
            if s.tier == NVME:
                disk += HEADER_BYTES + round_up(s.nbytes)
    cached = sum(1 for sg in sub_groups if placed.opt_tiers[sg[0]] == DEVICE)
    return StateAccount(by_kind_tier, experts, placed.staging, disk, placed.opt_tiers, len(sub_groups), cached)


# ---- one candidate, all stages -----------------------------------------------------------------------
@dataclass
class StagePlan:
    stage: int
    numel: int
    states: StateAccount
    nonstate: NonState
    model: StageModel | None = None  # the stage's parameters (its MoE layers and experts)

    def need(self) -> dict[str, int]:
        """Bytes this rank needs per tier: states, and the non-state memory of the tier it lives in."""
        st = self.states.by_tier
        return {DEVICE: st[DEVICE] + self.nonstate.device_side,
                HOST: st[HOST] + self.states.staging + self.nonstate.host_side,
                NVME: self.states.nvme_disk}


@dataclass
class Evaluation:
    option: Option
    stages: list[StagePlan]
    budgets: dict[str, int]  # per-rank engine budgets (memory_budget) for model states
    capacity: dict[str, int]  # per process: device, host, nvme (cpu: "ram" holds the device and host tiers)
    need: dict[str, int]  # per process, same keys: the largest need of any pipeline stage
    failures: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.failures


class Planner:
    """Plans one request; stage models, chunk plans and sub-groups are built once."""

    def __init__(self, request: Request):
        self.request = request
        self.device = torch.device(request.hardware.device)
        self.cpu = request.hardware.device == "cpu"
        v = request.layout.virtual_stages(request.model.num_layers // request.mesh.pp)
        self.stages = [build_stage(request.model, request.mesh, s, v)
                       for s in representative_stages(request.model, request.mesh.pp, v)]
        # Page sizes, largest first: one transformer layer per chunk, else one matrix (least gathered memory).
        self.pages = sorted({max(s.layer_weights for s in self.stages), max(s.layer_matrix for s in self.stages)},
                            reverse=True)
        self._plans: dict[tuple[int, str], list[list[ChunkPlan]]] = {}
        self._sub_groups: dict[tuple[int, int, int, str], list[list[int]]] = {}
        self._unbudgeted: dict[tuple, list[StateAccount]] = {}  # placements without a host budget
        self._evaluations: dict[tuple[Option, bool], Evaluation] = {}
        self._ranked: list[tuple[StepPrediction, Evaluation]] | None = None

    def layouts(self) -> tuple[str, ...]:
        """The layouts to try, fewest inter-node bytes first: all of them when a data-parallel group spans
        nodes with more than one member on each, else flat."""
        mesh = self.request.mesh
        return LAYOUTS if 1 < mesh.node_shard_dp < mesh.shard_dp else ("flat",)

    def plans(self, page: int, layout: str = "flat") -> list[list[ChunkPlan]]:
        """Every stage's chunks, packed by the engine's own code."""
        key = (page, layout)
        if key not in self._plans:
            mesh = self.request.mesh
            sizes = mesh.group_dp_sizes(mesh.node_shard_dp if layout == "mics" else 0)
            self._plans[key] = [plan_chunks(s.named, s.group_of, stage=3, page_numel=page, dp_size=mesh.shard_dp,
                                            persistence_threshold=persistence_threshold(self.request.model),
                                            isolated=s.isolated, group_dp_sizes=sizes)
                                for s in self.stages]
        return self._plans[key]

    def sub_groups(self, page: int, i: int, size: int, layout: str = "flat") -> list[list[int]]:
        key = (page, i, size, layout)
        if key not in self._sub_groups:
            self._sub_groups[key] = plan_sub_groups(self.plans(page, layout)[i], size)
        return self._sub_groups[key]

    def arena(self, option: Option) -> int:
        """One arena size for every rank: the largest any pipeline stage needs."""
        elem = self.request.dtype.itemsize
        return max(arena_numel([c.padded for c in plans if not c.resident], elem, option.keep_gathered)
                   for plans in self.plans(option.page, option.layout))

    def non_state(self, stage: StageModel, plans: list[ChunkPlan], option: Option) -> NonState:
        r = self.request
        # hpZ keeps 1/node of every partitioned dense chunk as its secondary shard, in the compute dtype.
        secondary = (sum(c.padded for c in plans if not c.resident and c.group != EXPERT_GROUP)
                     // r.mesh.node_shard_dp if option.layout == "hpz" else 0)
        ns = non_state(r.model, r.mesh, stage, plans, micro_batch=option.micro_batch_size,
                       recompute=option.recompute, arena=self.arena(option), cpu=self.cpu,
                       overhead=r.hardware.overhead,
                       layout=dataclasses.replace(r.layout, pipeline_schedule=option.schedule),
                       results_miss_shards=option.offload in ("nvme", "cpu+nvme") or r.accumulation_steps > 1,
                       secondary=secondary)
        # A snapshot holds the shard's fp32 masters and both Adam moments; the next one is written before the
        # previous one is removed.
        snapshots = r.snapshot_copies * 2 * 12 * sum(c.shard for c in plans)
        return dataclasses.replace(ns, snapshots=snapshots) if snapshots else ns

    def keep_choices(self) -> tuple[bool, ...]:
        """keep_gathered, fastest first: on an accelerator the gathered parameters stay for the backward when
        device memory allows; on a CPU machine the device tier is host memory, kept for the states."""
        return (False,) if self.cpu else (True, False)

    def sub_group_sizes(self, page: int, offload: str = "none", layout: str = "flat") -> list[int]:
        """Candidates, largest first: from about 10 sub-groups per stage down to one chunk each. With states
        on SSD, only sizes whose three sub-groups in flight (pipeline_optimizer; at most 16 bytes per
        element: master, Adam moments, gradient) take at most a quarter of the host memory per process."""
        plans = self.plans(page, layout)
        total = max(sum(c.shard for c in p) for p in plans)
        one_chunk = max(c.shard for p in plans for c in p)
        top = max(total // 10, one_chunk)
        sizes = [s for s in SUB_GROUP_SIZES if one_chunk < s <= top] + [one_chunk]
        if offload in ("cpu+nvme", "nvme"):
            cap = self.capacity()
            host = cap["ram"] if self.cpu else cap[HOST]
            sizes = [s for s in sizes if 3 * 16 * s <= host // 4] or sizes[-1:]
        return sizes

    def capacity(self) -> dict[str, int]:
        """What one process may use: its share of the node's host memory and disk, and its accelerator."""
        hw, n = self.request.hardware, self.request.mesh.nproc_per_node
        host = int(HOST_SHARE * hw.host_memory / n)
        nvme = int(NVME_SHARE * hw.nvme_free / n)
        if self.cpu:
            return {"ram": host, NVME: nvme}
        return {DEVICE: int(DEVICE_SHARE * hw.device_memory), HOST: host, NVME: nvme}

    def parse(self, option: Option, budgets: dict[str, int] | None) -> tuple[dict, ZeroCacheConfig]:
        raw = ds_config(self.request, option, self.arena(option), budgets)
        return raw, parse_config(raw, self.request.mesh.shard_dp)

    def evaluate(self, option: Option, *, ignore_capacity: bool = False) -> Evaluation:
        key = (option, ignore_capacity)
        if key not in self._evaluations:
            self._evaluations[key] = self._evaluate(option, ignore_capacity)
        return self._evaluations[key]

    def _evaluate(self, option: Option, ignore_capacity: bool) -> Evaluation:
        """Place every stage's states for ``option`` and check them, with the non-state memory, against the
        per-process capacity. The engine takes one set of budgets for all ranks, so the check is on the
        largest need of any stage per tier."""
        cap = self.capacity()
        if ignore_capacity:
            cap = dict.fromkeys(cap, sys.maxsize // 4)
        _, cfg = self.parse(option, None)
        plans = self.plans(option.page, option.layout)
        nonstate = [self.non_state(s, p, option) for s, p in zip(self.stages, plans)]
        sgs = [self.sub_groups(option.page, i, option.sub_group_size, option.layout) for i in range(len(self.stages))]
        dtype = self.request.dtype
        # The device-tier states do not depend on the host budget (what spills goes from the host to SSD).
        key = (option.offload, option.page, option.sub_group_size, option.rate, option.layout)
        if key not in self._unbudgeted:
            self._unbudgeted[key] = [account_states(p, sg, cfg, dtype, self.device, sys.maxsize)
                                     for p, sg in zip(plans, sgs)]
        accounts = self._unbudgeted[key]
        dev_states = max(a.by_tier[DEVICE] for a in accounts)
        host_overhead = max(ns.host_side for ns in nonstate)  # the runtime, and offloaded activations
        if self.cpu:  # one pool of host memory holds both tiers and everything else
            ram_left = cap["ram"] - max(ns.device_side for ns in nonstate) - host_overhead
            budgets = {DEVICE: ram_left, HOST: ram_left - dev_states, NVME: cap[NVME]}
        else:
            budgets = {DEVICE: cap[DEVICE] - max(ns.device_side for ns in nonstate),
                       HOST: cap[HOST] - host_overhead, NVME: cap[NVME]}
        failures: list[str] = []
        if option.offload in ("cpu+nvme", "nvme"):  # beyond the host budget, states spill to SSD
            try:
                accounts = [account_states(p, sg, cfg, dtype, self.device, max(budgets[HOST], 0))
                            for p, sg in zip(plans, sgs)]
            except ZeroConfigError:
                failures.append(self._host_failure(cap, budgets[HOST]))
        stages = [StagePlan(s.stage, s.numel, a, ns, s) for s, a, ns in zip(self.stages, accounts, nonstate)]
        host_states = max(a.by_tier[HOST] + a.staging for a in accounts)
        disk = max(a.nvme_disk for a in accounts)
        if self.cpu:
            budgets[DEVICE] -= host_states
            need = {"ram": dev_states + host_states + cap["ram"] - ram_left, NVME: disk}
        else:
            need = {DEVICE: dev_states + cap[DEVICE] - budgets[DEVICE], HOST: host_states + host_overhead, NVME: disk}
        hw, n = self.request.hardware, self.request.mesh.nproc_per_node
        whole = {"ram": ("host memory", HOST_SHARE, hw.host_memory, n),
                 HOST: ("host memory", HOST_SHARE, hw.host_memory, n),
                 DEVICE: ("accelerator memory", DEVICE_SHARE, hw.device_memory, 1),
                 NVME: (f"disk under {hw.nvme_path}", NVME_SHARE, hw.nvme_free, n)}
        for resource, amount in need.items():
            what, share, total, procs = whole[resource]
            if amount > cap[resource] and not (failures and resource in ("ram", HOST)):
                failures.append(f"{what}: {format_bytes(amount)} per process > {format_bytes(cap[resource])} "
                                f"({share:.0%} of {format_bytes(total)}{f' / {procs} processes' if procs > 1 else ''})")
        if option.offload == "cpu":
            budgets[NVME] = 0  # host only: the engine refuses to spill rather than use the disk
        ev = Evaluation(option, stages, budgets, cap, need, failures)
        ev.config = self.parse(option, {k: max(0, v) for k, v in budgets.items()})[0]
        return ev

    def _host_failure(self, cap: dict[str, int], budget: int) -> str:
        """Why the states that must stay in host memory do not fit: the room left for them is too small, or
        what every process needs before any state (activations, gathered parameters, buffers, the states of
        the device tier, the runtime) already takes all of it."""
        hw, n = self.request.hardware, self.request.mesh.nproc_per_node
        room = cap["ram"] if self.cpu else cap[HOST]
        of = f"({HOST_SHARE:.0%} of {format_bytes(hw.host_memory)}{f' / {n} processes' if n > 1 else ''})"
        if budget > 0:
            return (f"host memory: the states that must stay on the host exceed the {format_bytes(budget)} per "
                    f"process left of {format_bytes(room)} {of}, even with every optimizer sub-group and gradient "
                    f"shard the engine can move on SSD")
        before = "activations, gathered parameters, buffers and device-tier states" if self.cpu else \
            "the runtime and offloaded activations" if self.request.layout.offloaded_layers else "the runtime"
        return (f"host memory: {before} take {format_bytes(room - budget)} per process before any model state, "
                f"more than the {format_bytes(room)} a process gets {of}")

    def best_rate(self, option: Option) -> Evaluation:
        """The prefetch_cache_sub_group_rate (share of sub-groups on the device): the largest that fits, and with
        an accelerator's speeds no more than the one at which the device's and the host's optimizer parts
        finish together (step_time.balanced_rate)."""
        ev = self.largest_rate(option)
        speeds = self.request.speeds
        if speeds is None or self.cpu or option.offload == "none" or ev.option.rate == 0:
            return ev
        step = math.floor(balanced_rate(speeds, self._writeback_per_elem(ev)) * RATE_STEPS)
        if step / RATE_STEPS < ev.option.rate:
            ev = self.evaluate(dataclasses.replace(ev.option, rate=step / RATE_STEPS))
        return ev

    def _writeback_per_elem(self, ev: Evaluation) -> float:
        """Bytes copied back to the device per host-updated element (the parameters that live there)."""
        work = [self.step_work(ev, i) for i in range(len(ev.stages))]
        away = sum(w.host_elems + w.ssd_elems for w in work)
        return sum(w.writeback_bytes for w in work) / away if away else 0.0

    def step_work(self, ev: Evaluation, i: int) -> StepWork:
        """Stage ``i``'s work per step on one rank, from its placement."""
        st, plans = ev.stages[i], self.plans(ev.option.page, ev.option.layout)[i]
        tiers, by = st.states.opt_tiers, st.states.by_kind_tier
        elem = self.request.dtype.itemsize
        steps = self.micro_batches(ev.option)
        away = lambda kind: by.get((kind, HOST), 0) + by.get((kind, NVME), 0)  # noqa: E731
        elems = {t: sum(p.shard for p in plans if tiers[p.index] == t) for t in TIERS}
        resident_away = sum(p.shard for p in plans if p.resident and tiers[p.index] != DEVICE)
        cfg = self.request.model
        # 6 x the parameters a token computes with (of an MoE layer: its top-k experts) x the rank's tokens (1/CP of
        # each sequence). Attention's own FLOPs are not counted.
        tokens = ev.option.micro_batch_size * cfg.seq_length // self.request.mesh.cp
        flops = 6 * self.stages[i].active_numel * tokens * steps * (4 / 3 if ev.option.recompute else 1)
        # Host-updated parameters go back to the device unless the parameter shards live on the host anyway
        # (offload_param, then only resident chunks are written back).
        writeback = (elems[HOST] + elems[NVME] if away("params") == 0 else resident_away) * elem
        # Parameter shards cross once per gather: for the forward and the backward of every micro-batch, or once
        # a step when the arena keeps every chunk gathered until the parameters change.
        gathers = 1 if ev.option.keep_gathered else 2 * steps
        return StepWork(flops=flops, h2d_bytes=gathers * away("params"), d2h_bytes=steps * away("grads") / 4 * elem,
                        writeback_bytes=writeback, device_elems=elems[DEVICE], host_elems=elems[HOST],
                        ssd_elems=elems[NVME], ssd_bytes=2 * sum(n for (_, t), n in by.items() if t == NVME))

    def breakdown(self, ev: Evaluation) -> StepBreakdown | None:
        """The offload lanes of the slowest pipeline stage (None without speeds: a CPU plan without --measure)."""
        if self.request.speeds is None:
            return None
        return max((predict(self.step_work(ev, i), self.request.speeds) for i in range(len(ev.stages))),
                   key=lambda b: b.step_s)

    def micro_batches(self, option: Option) -> int:
        """Micro-batches per step: the requested ones, more where the option lowered the micro-batch (the global
        batch stays)."""
        r = self.request
        return max(1, r.accumulation_steps * r.micro_batch_size // option.micro_batch_size)

    def workload(self, ev: Evaluation) -> Workload:
        """The step-time model's view of ``ev``: the request's model and mesh with the option's micro-batch,
        recompute and ZeRO-3 layout; micro-batches per step keep the requested global batch."""
        r, opt = self.request, ev.option
        mesh, layout = r.mesh, r.layout
        v = layout.virtual_stages(r.model.num_layers // mesh.pp)
        parallel = Parallel(tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, ep=mesh.ep, dp=mesh.dp, virtual_stages=v,
                            schedule=opt.schedule, sequence_parallel=layout.seq_split(mesh.tp) > 1,
                            cp_comm_type=layout.cp_comm_type)
        micro_batches = self.micro_batches(opt)
        recompute = "full" if opt.recompute else layout.granularity
        zero = DataParallel("zero3", layout=opt.layout, keep_gathered=opt.keep_gathered)
        return Workload(ModelShape.from_config(r.model), parallel, opt.micro_batch_size, micro_batches, recompute,
                        attention="flash" if not self.cpu or r.model.attention_dropout == 0 else "materialized",
                        dtype_bytes=r.dtype.itemsize, data_parallel=zero,
                        stage_params=max(st.numel for st in ev.stages),
                        active_params=r.model.num_parameters(active=True))

    def predict(self, ev: Evaluation, work: Workload | None = None) -> StepPrediction | None:
        """The predicted step of ``ev`` on the request's profile (None without one: a CPU plan without --measure);
        ``work``: ``self.workload(ev)`` as the caller changed it (benchmarks/planner_validation.py adds the trainer's
        own time and prices a Megatron DDP run)."""
        profile = self.request.profile
        if profile is None:
            return None
        offload = self.breakdown(ev) if ev.option.offload != "none" else None
        return predict_step(work or self.workload(ev), profile.with_nodes_of(self.request.mesh.nproc_per_node),
                            offload)

    def largest_rate(self, option: Option) -> Evaluation:
        """The largest prefetch_cache_sub_group_rate (share of sub-groups on the device) that fits."""
        if option.offload == "none":
            return self.evaluate(option)

        def device_ok(step: int) -> tuple[bool, Evaluation]:
            ev = self.evaluate(dataclasses.replace(option, rate=step / RATE_STEPS))
            if self.cpu:
                return ev.fits, ev
            return ev.need[DEVICE] <= ev.capacity[DEVICE], ev

        ok, ev = device_ok(RATE_STEPS)  # everything on the device
        if ok:
            return ev
        ok, ev = device_ok(0)
        if not ok or not device_ok(1)[0]:
            return ev
        lo, hi = 1, RATE_STEPS - 1  # device_ok(lo) holds; find the largest such step
        best = device_ok(1)[1]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok, cand = device_ok(mid)
            if ok:
                lo, best = mid, cand
            else:
                hi = mid - 1
        return best

    def activation_options(self) -> list[tuple[int, bool]]:
        mb = self.request.micro_batch_size
        out = [] if self.request.recompute_forced else [(mb, False)]
        while True:
            if self.request.recompute_allowed:
                out.append((mb, True))
            if mb == 1:
                return out
            mb = max(1, mb // 2)
            if not self.request.recompute_allowed:
                out.append((mb, False))

    def search(self) -> Evaluation:
        """The fastest predicted option that fits (with a profile: a GPU plan's, or --measure's), else the first
        that fits in the order of the rules; when none fits, the leanest option's evaluation (its failures say what is
        missing)."""
        if self.request.profile is not None:
            ranked = self.ranked()
            return ranked[0][1] if ranked else self.evaluate(self.leanest())
        return self.first_fit()

    def schedules(self) -> tuple[str, ...]:
        """Pipeline schedules to try, in the order of the rules. With PP > 1 and one model chunk per stage: the
        requested one, else both 1F1B and ZB-H1 (its bubble is smaller, its later stages hold more activations).
        Otherwise 1F1B: no pipeline, or the interleaved schedule, which follows from the layout."""
        r = self.request
        if r.mesh.pp == 1 or r.layout.virtual_stages(r.model.num_layers // r.mesh.pp) > 1:
            return ("1f1b",)
        if r.layout.pipeline_schedule is not None:
            return (r.layout.pipeline_schedule,)
        return ("1f1b", "zb-h1")

    def candidates(self) -> Iterator[Evaluation]:
        """Per offload (the first page where the leanest activations fit), activation choice, layout and pipeline
        schedule: the first option that fits, largest sub-groups and kept-gathered arena first; in the order of
        the rules."""
        for offload in self.request.offloads:
            for page in self.pages:
                sizes = {x: self.sub_group_sizes(page, offload, x) for x in self.layouts()}
                sizes = {x: s[:1] if offload == "none" else s for x, s in sizes.items()}
                if not self.best_rate(Option(offload, page, 1, self.request.recompute_allowed,
                                             sizes["flat"][-1], schedule=self.schedules()[0])).fits:
                    continue  # not even the leanest activations fit
                for mb, rc in self.activation_options():
                    for (layout, layout_sizes), schedule in itertools.product(sizes.items(), self.schedules()):
                        ev = next((ev for size in layout_sizes for keep in self.keep_choices()
                                   if (ev := self.best_rate(Option(offload, page, mb, rc, size, keep_gathered=keep,
                                                                   layout=layout, schedule=schedule))).fits), None)
                        if ev is not None:
                            yield ev
                break

    def ranked(self) -> list[tuple[StepPrediction, Evaluation]]:
        """Every candidate that fits with its predicted step, fewest seconds per token first."""
        if self._ranked is None:
            scored = [(self.predict(ev), ev) for ev in self.candidates()]
            self._ranked = sorted(scored, key=lambda pe: pe[0].step_s / pe[0].tokens)
        return self._ranked

    def first_fit(self) -> Evaluation:
        """The first candidate, fastest first by rule (offload, then page, activations, sub-group size); the leanest
        option's evaluation when none fits."""
        return next(self.candidates(), None) or self.evaluate(self.leanest())

    def leanest(self) -> Option:
        """Least memory per process: states on SSD (if allowed), smallest pages and sub-groups, micro-batch 1,
        full recompute (unless activations are offloaded)."""
        offload = "nvme" if "nvme" in self.request.offloads else self.request.offloads[-1]
        page = self.pages[-1]
        return Option(offload, page, 1, self.request.recompute_allowed, self.sub_group_sizes(page)[-1],
                      schedule=self.schedules()[0])

    def feasible(self) -> bool:
        """Whether any allowed offload fits with the leanest pages and activations (on a CPU machine the
        leanest rate is 0: a sub-group on the device is host memory too). Offloads are tried from the
        leanest in memory; once one fails on memory rather than disk, the rest cannot fit either."""
        lean = self.leanest()
        for offload in reversed(self.request.offloads):
            option = dataclasses.replace(lean, offload=offload)
            ev = self.evaluate(option) if self.cpu else self.best_rate(option)
            if ev.fits:
                return True
            if any(not f.startswith("disk") for f in ev.failures):
                return False
        return False

    def on_hardware(self, hardware: Hardware) -> Planner:
        """The same model and mesh on other hardware (stage models, chunks and placements are reused)."""
        other = copy.copy(self)
        other.request = dataclasses.replace(self.request, hardware=hardware)
        other._evaluations = {}
        other._ranked = None
        return other

    def requirements(self, option: Option) -> dict[str, int]:
        """The least hardware per node (and per accelerator) on which ``option`` fits. With states on SSD
        the engine spills to disk whatever the host cannot hold, so the host memory is searched (disk
        unlimited) and the disk is what the plan needs with that host memory."""
        hw, n = self.request.hardware, self.request.mesh.nproc_per_node
        need = self.evaluate(option, ignore_capacity=True).need
        device = 0 if self.cpu else math.ceil(need[DEVICE] / DEVICE_SHARE)
        host = math.ceil(n * need["ram" if self.cpu else HOST] / HOST_SHARE) + n

        def on(host_memory: int, nvme_free: int = 2**62) -> Planner:
            return self.on_hardware(dataclasses.replace(hw, host_memory=host_memory, nvme_free=nvme_free,
                                                        device_memory=device or hw.device_memory))

        if option.offload in ("cpu+nvme", "nvme") and on(host).evaluate(option).fits:
            lo, hi = 0, host  # on(hi) fits; stop within 1/256 of the answer
            while hi - lo > hi // 256:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if on(mid).evaluate(option).fits else (mid, hi)
            host = hi
        disk = on(host).evaluate(option).need[NVME]
        out = {"host_memory": host, "nvme_free": math.ceil(n * disk / NVME_SHARE) + n if disk else 0}
        if not self.cpu:
            out["device_memory"] = device
        return out


# ---- requests of the same family (ptm_planner.family) ------------------------------------------------
def with_layers(request: Request, layers: int) -> Request:
    return dataclasses.replace(request, model=dataclasses.replace(request.model, num_layers=layers))


def with_seq(request: Request, seq_length: int) -> Request:
    """The request at another sequence length (learned positions: as many position embeddings)."""
    return dataclasses.replace(request, model=dataclasses.replace(request.model, seq_length=seq_length,
                                                                  max_position_embeddings=seq_length))


def with_experts(request: Request, experts: int) -> Request:
    moe = dataclasses.replace(request.model.moe, num_experts=experts)
    return dataclasses.replace(request, model=dataclasses.replace(request.model, moe=moe))


# ---- bytes as text -----------------------------------------------------------------------------------
def format_bytes(n: int) -> str:
    """Bytes in GiB, or in MiB / KiB when smaller (tiny models)."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if abs(n) >= size / 10:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"
