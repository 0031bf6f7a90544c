"""The engine's parts, built once from one validated config, in dependency order; the engine only runs them.

    plan (chunks per shard group, sub-groups) ─▶ placement (tiers under the budgets) ─▶ copy streams
      ─▶ collectives per shard group ─▶ store ─▶ chunks ─▶ host lane ─▶ coordinator ─▶ optimizer
      ─▶ update strategy ─▶ gradient reducer

Every part gets its collaborators in its constructor; the chunk lifecycle's dispatcher (lifecycle.py) is made
first and its listeners are subscribed here, before any hook can fire. Nothing is changed after construction.

Shard groups: every trainable parameter belongs to one entry of ``param_groups``; an entry may name the process
group its chunks are sharded over (``dp_group``, default: the engine's) and the factor that turns the reduced
gradient sum into the gradient (``gradient_scaling_factor``, default 1/size of that group: the mean). A mixture
of experts shards the dense parameters over the data-parallel group and the experts over the expert-data-
parallel group, whose gradients are scaled by 1/(data-parallel size) (Megatron-core's rule: each expert saw the
tokens of the whole data-parallel group). Every shard group lies inside the engine's ``dp_group``, over which the
global gradient norm is summed; a parameter must be held by exactly one rank of it after sharding, or be left
out of the norm by ``param_in_grad_norm``.

Hierarchical layouts (topology.py, chunk_collectives.py) apply to the groups split over the engine's own
``dp_group``: MiCS shards them over a block of it and replicates across blocks (the gradient then divides by the
whole data-parallel size, and only the first replica of a shard counts in the norm); hpZ, qwZ and qgZ change how
their chunks are gathered and reduced. A caller's own shard groups (experts) stay flat, with qwZ when it is on.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .chunk import FlatChunk
from .chunk_collectives import ChunkCollectives
from .chunk_init import ParamInit, build_chunk
from .comm import Comm, CommProfiler
from .config import ZeroCacheConfig, ZeroConfigError
from .coordinator import ParamCoordinator
from .grad_norm import NormRanges
from .grad_reducer import GradReducer
from .host_lane import HostLane
from .host_memory import set_malloc_for_start_up, set_malloc_for_training
from .lifecycle import ChunkEvents
from .loss_scaler import LossScaler
from .optimizer import GroupHParams, ShardedAdam
from .param_refresh import ParamRefresh
from .partition import ChunkPlan, plan_chunks, plan_sub_groups
from .pinned_memory import HostArena
from .placement import copy_staging_units, machine_budgets, place_states
from .shard_states import ShardStates, StepCount
from .speculation import Speculation
from .ssd_store import SSDStore
from .store import HOST, NVME, DeviceHostStore, ShardStore
from .streams import Streams, make_streams
from .topology import build_topology
from .update import UpdateStrategy, choose_update

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    """Everything an engine runs, built by ``build_engine_parts``."""
    module: nn.Module
    config: ZeroCacheConfig
    dtype: torch.dtype  # compute dtype
    device: torch.device
    comm: Comm  # the engine's data-parallel group: the norm, the overflow flag, exports
    model_parallel_group: object
    profiler: CommProfiler
    plans: list[ChunkPlan]
    sub_groups: list[list[int]]
    budgets: dict[str, int]
    streams: Streams
    store: ShardStore
    chunks: list[FlatChunk]
    lane: HostLane | None
    events: ChunkEvents
    coordinator: ParamCoordinator | None  # None when every chunk is resident
    optimizer: ShardedAdam
    refresh: ParamRefresh
    update: UpdateStrategy
    reducer: GradReducer
    scaler: LossScaler
    steps: StepCount
    states: ShardStates  # what the checkpoint code reads and writes


@dataclass(frozen=True)
class _Groups:
    """The optimizer's parameter groups and the shard group each one is split over."""
    hparams: list[GroupHParams]
    group_of: dict[int, int]  # id(param) -> group index
    process_groups: list[object]  # per group: its shard group (None: the engine's dp_group)
    factors: list[float | None]  # per group: gradient_scaling_factor (None: 1/size of its shard group)


def build_engine_parts(model: nn.Module, cfg: ZeroCacheConfig, *, dp_group=None, model_parallel_group=None,
                       param_in_grad_norm: Callable[[nn.Parameter], bool] | None = None,
                       tied_param_groups: Iterable[tuple[nn.Parameter, object]] | None = None,
                       param_groups: list[dict] | None = None, store: ShardStore | None = None,
                       param_init: ParamInit | None = None) -> EngineParts:
    set_malloc_for_start_up()  # chunk-sized temporaries go back to the OS, not into heap holes
    z = cfg.zero_optimization
    dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
    managed = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not managed:
        raise ValueError("zero_cache.initialize: the model has no parameters that require grad")
    device = managed[0][1].device
    if device.type == "meta":
        raise ValueError("zero_cache.initialize: the model is on the meta device; call "
                         "zero_cache.storage_less_parameters(model, device) first and pass param_init")
    groups = _param_groups(managed, param_groups, cfg.optimizer.params.weight_decay, dp_group)
    dp_size = _group_size(dp_group)
    topology = build_topology(z, dp_group)
    # The engine's own groups are split over the layout's shard group (MiCS: a block of the data-parallel group).
    shard_groups = [g if g is not None else topology.shard if topology.shard is not None else dp_group
                    for g in groups.process_groups]
    tied = list(tied_param_groups or [])
    plans = plan_chunks(managed, groups.group_of, stage=z.stage, page_numel=z.allgather_bucket_size,
                        dp_size=dp_size, persistence_threshold=z.stage3_param_persistence_threshold,
                        isolated={id(p) for p, _ in tied},
                        group_dp_sizes=[_group_size(g) for g in shard_groups])
    sub_groups = plan_sub_groups(plans, z.sub_group_size)
    budgets = machine_budgets(cfg, device)
    placed = place_states(plans, sub_groups, cfg, dtype, device, budgets)
    tiers = placed.opt_tiers

    # Host <-> device copies go through copy streams (CUDA, or the emulated accelerator on CPU).
    streams = make_streams(cfg, device, _global_rank())
    streams.configure_staging(*copy_staging_units(plans, placed.layouts, cfg, device))
    profiler = CommProfiler(z.is_communication_time_profiling)
    comms: dict[int, Comm] = {}

    def comm_of(group) -> Comm:
        if id(group) not in comms:
            comms[id(group)] = Comm(group, profiler, p2p_on_gloo=z.gloo_p2p_collectives, streams=streams)
        return comms[id(group)]

    comm = comm_of(dp_group)
    group_collectives = []
    for g, own in zip(shard_groups, groups.process_groups):
        if own is not None:  # a group of the caller's (experts): flat over it
            group_collectives.append(ChunkCollectives(comm_of(g), quantize_weights=z.zero_quantized_weights,
                                                      block=z.quantization_block_size))
            continue
        group_collectives.append(ChunkCollectives(
            comm_of(g), replicate=comm_of(topology.replicate) if topology.replicate is not None else None,
            node=comm_of(topology.node) if topology.node is not None else None,
            cross=comm_of(topology.cross) if topology.cross is not None else None,
            secondary=z.zero_hpz_partition_size > 1, quantize_weights=z.zero_quantized_weights,
            quantize_grads=z.zero_quantized_gradients, block=z.quantization_block_size,
            grad_bits=z.quantized_gradients_bits, two_hop=topology.node is not None and comm_of(g).p2p,
            error_feedback=z.quantized_gradients_error_feedback))

    pin = z.offload_param.pin_memory or z.offload_optimizer.pin_memory
    host_bytes = HostArena.reserve_for([s.nbytes for layout in placed.layouts for s in layout if s.tier == HOST])
    params_on_ssd = z.offload_param.device == "nvme" and z.stage == 3
    if store is None and (NVME in tiers or params_on_ssd):
        path = z.offload_optimizer.nvme_path if NVME in tiers else z.offload_param.nvme_path
        store = SSDStore(device, path, cfg.aio, rank=_global_rank(), pin_host=pin, budgets=budgets,
                         staging_bytes=placed.opt_staging, param_staging_bytes=placed.param_staging,
                         pinning=streams.pinning, copy_staging=placed.copy_staging, host_bytes=host_bytes)
    if store is None:
        store = DeviceHostStore(device, pin_host=pin, budgets=budgets, pinning=streams.pinning,
                                copy_staging=placed.copy_staging, host_bytes=host_bytes)
    with torch.no_grad():
        chunks = []
        for p in plans:
            c = group_collectives[p.group]
            factor = groups.factors[p.group]
            mean = 1.0 / (c.shard.size * c.replicas)  # the gradient sums over every replica of the shard
            chunks.append(build_chunk(p, tiers[p.index], store, c, mean if factor is None else factor, cfg,
                                      dtype, device, param_init, p.index in placed.grad_on_ssd))
    chunk_of = {id(s.param): c.index for c in chunks for s in c.plan.slots}

    # The host's share of the work (gradients landing, host sub-groups) runs beside the device's.
    lane = HostLane(streams.meter) if placed.copy_staging else None
    events = ChunkEvents()
    coordinator = None
    if any(not c.plan.resident for c in chunks):
        coordinator = ParamCoordinator(model, chunks, events, z, store, streams,
                                       micro_batches=cfg.gradient_accumulation_steps,
                                       keep_param_bytes=placed.param_keep)
        events.subscribe(coordinator)
    hp = cfg.optimizer.params
    optimizer = ShardedAdam(chunks, sub_groups, groups.hparams, lr=hp.lr, betas=hp.betas, eps=hp.eps,
                            decoupled=cfg.optimizer.decoupled, pipeline=z.pipeline_optimizer, store=store,
                            streams=streams, lane=lane)
    refresh = ParamRefresh(chunks, optimizer, coordinator)
    speculation = None
    if z.speculative_update and lane is not None:
        tied_chunks = {chunk_of[id(p)] for p, _ in tied}
        # Tied and replicated shards change after the backward (summed across groups at the step): not final early.
        eligible = [all(chunks[i].opt_tier == HOST and not chunks[i].swapped and i not in tied_chunks
                        and chunks[i].collectives.replicate is None for i in sg)
                    for sg in sub_groups]
        speculation = Speculation(optimizer, chunks, sub_groups, eligible, store, lane)
    elif z.speculative_update:
        logger.warning("zero_cache: speculative_update acts only with an accelerator (or the emulated one) and "
                       "optimizer states in host memory; it has no effect here")
    update = choose_update(z, optimizer, refresh, chunks, store, speculation)
    events.subscribe(update)
    reducer = GradReducer(chunks, events, store, mode="full" if z.stage == 1 else "shard",
                          max_events=z.max_param_reduce_events, tied_groups={chunk_of[id(p)]: g for p, g in tied},
                          norm_ranges=_norm_ranges(chunks, param_in_grad_norm), streams=streams, lane=lane)
    scaler, steps = LossScaler(cfg.fp16), StepCount()
    states = ShardStates(model, cfg, chunks, store, comm, model_parallel_group, optimizer, scaler, update, refresh,
                         steps)
    if z.reuse_freed_host_memory:
        set_malloc_for_training()  # each micro-batch's tensors reuse the last one's memory
    return EngineParts(module=model, config=cfg, dtype=dtype, device=device, comm=comm,
                       model_parallel_group=model_parallel_group, profiler=profiler, plans=plans,
                       sub_groups=sub_groups, budgets=budgets, streams=streams, store=store, chunks=chunks, lane=lane,
                       events=events, coordinator=coordinator, optimizer=optimizer, refresh=refresh, update=update,
                       reducer=reducer, scaler=scaler, steps=steps, states=states)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _group_ranks(group) -> set[int]:
    if group is None:
        return set(range(dist.get_world_size()))
    return set(dist.get_process_group_ranks(group))


_GROUP_KEYS = {"params", "weight_decay", "dp_group", "gradient_scaling_factor"}


def _param_groups(managed, param_groups, default_wd, dp_group) -> _Groups:
    if param_groups is None:
        return _Groups([GroupHParams(default_wd)], {id(p): 0 for _, p in managed}, [None], [None])
    hparams, group_of, process_groups, factors = [], {}, [], []
    for g, spec in enumerate(param_groups):
        unknown = set(spec) - _GROUP_KEYS
        if unknown or "params" not in spec:
            raise ValueError(f"zero_cache.initialize: param_groups[{g}] must be {{'params': [...], "
                             f"'weight_decay': float, 'dp_group': process group, 'gradient_scaling_factor': float}} "
                             f"(all but 'params' optional), got keys {sorted(spec)}")
        hparams.append(GroupHParams(float(spec.get("weight_decay", default_wd))))
        group = spec.get("dp_group")
        if group is not None:
            if not dist.is_initialized():
                raise ZeroConfigError(f"zero_cache.initialize: param_groups[{g}] names a dp_group but "
                                      f"torch.distributed is not initialised")
            outside = _group_ranks(group) - _group_ranks(dp_group)
            if outside:
                raise ZeroConfigError(f"zero_cache.initialize: param_groups[{g}]'s dp_group holds ranks "
                                      f"{sorted(outside)} outside the engine's dp_group; every shard group must "
                                      f"lie inside it (the gradient norm is summed over it)")
        process_groups.append(group)
        factor = spec.get("gradient_scaling_factor")
        factors.append(None if factor is None else float(factor))
        for p in spec["params"]:
            if id(p) in group_of:
                raise ValueError(f"zero_cache.initialize: a parameter appears in param_groups {group_of[id(p)]} "
                                 f"and {g}; list each parameter once")
            group_of[id(p)] = g
    missing = [n for n, p in managed if id(p) not in group_of]
    if missing:
        raise ValueError(f"zero_cache.initialize: parameters {missing[:5]} are in no param group; "
                         f"every trainable parameter must be listed")
    return _Groups(hparams, group_of, process_groups, factors)


def _norm_ranges(chunks: list[FlatChunk], counts: Callable[[nn.Parameter], bool] | None) -> list[NormRanges]:
    """Per chunk: None (the whole shard counts in the grad norm) or the shard ranges that count (none on the
    replicas of a shard other than the first)."""
    out = []
    for c in chunks:
        if not c.collectives.counts_in_norm:  # another replica of this shard counts it
            out.append([])
        elif counts is None or all(counts(s.param) for s in c.plan.slots):
            out.append(None)
        else:
            out.append([(g.shard_lo, g.shard_hi) for g in c.segments if counts(g.slot.param)])
    return out
