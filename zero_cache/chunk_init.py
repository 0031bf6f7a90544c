"""Start-up: pack the model's parameters into chunks and allocate every shard in the store.

Placement rules (one authoritative home per state):
- Partitioned chunk (stage 3): the parameter shard lives on the host with ``offload_param: cpu``, in an
  SSD page file with ``nvme``, else on the device; the full buffer exists only while gathered.
- Resident chunk: the full buffer lives on the device; the parameter shard is a view of it.
- Optimizer tier of a sub-group: host (``offload_optimizer: cpu``) or SSD (``nvme``) except the first
  ``prefetch_cache_sub_group_rate`` share of sub-groups, which stay on the device; else the device.
  fp32 master, gradient shard and Adam moments live there; on the SSD tier the gradient shard stays on
  the host (it is accumulated during backward) and master and moments are page files.
- In fp32 the parameter shard *is* the master (no copy): a partitioned chunk keeps it in the optimizer
  tier (host memory when that tier is SSD), a resident chunk uses its view when the optimizer tier is the
  device or SSD with a CPU compute device. Otherwise a separate fp32 master exists (bf16/fp16, or
  resident chunks whose optimizer is offloaded).
The rules are code in ``placement.chunk_layout`` (placement under budgets uses the same function).
Values are broadcast from DP rank 0 so every replica starts identical. A parameter without storage
(lazy_init.py) gets its values from ``param_init`` here, one chunk at a time.
"""
from __future__ import annotations

from typing import Callable

import torch

from .chunk import FlatChunk
from .chunk_collectives import ChunkCollectives
from .config import ZeroCacheConfig
from .lazy_init import has_no_storage
from .partition import ChunkPlan
from .placement import chunk_layout
from .states import State
from .store import DEVICE, NVME, ShardStore

ParamInit = Callable[[str, torch.nn.Parameter], torch.Tensor]


def build_chunk(plan: ChunkPlan, opt_tier: str, store: ShardStore, collectives: ChunkCollectives, grad_factor: float,
                cfg: ZeroCacheConfig, dtype: torch.dtype, device: torch.device, param_init: ParamInit | None = None,
                grad_on_ssd: bool = False) -> FlatChunk:
    """Allocate chunk ``plan``'s states in the store and fill them; ``collectives`` span its shard group."""
    # The chunk's initial values, fp32, broadcast so that every replica of a shard starts identical.
    init = torch.zeros(plan.padded, dtype=torch.float32, device=device)
    for s in plan.slots:
        if has_no_storage(s.param):  # built lazily (lazy_init.py): its values exist only now
            if param_init is None:
                raise ValueError(f"zero_cache.initialize: parameter '{s.name}' has no storage; pass param_init="
                                 f"fn(name, param) returning its initial values")
            value = param_init(s.name, s.param)
        else:
            value = s.param.detach()
        init[s.offset:s.offset + s.numel].copy_(value.reshape(-1))
        del value
    collectives.broadcast_init(init)

    layout = {spec.state: spec for spec in chunk_layout(plan, opt_tier, cfg, dtype, device, grad_on_ssd)}

    def alloc(state: State) -> None:
        spec = layout[state]
        chunk.attach(state, store.allocate(chunk.key(state), spec.kind, spec.tier, spec.numel, spec.dtype))
        if spec.tier == NVME:
            chunk.swapped.append(state)

    if plan.resident:
        full = store.allocate(f"c{plan.index}.{State.FULL.value}", "params", DEVICE, plan.padded, dtype)
    else:
        full = torch.empty(plan.padded, dtype=dtype, device=device)
    full.copy_(init)
    chunk = FlatChunk(plan, collectives, full, grad_factor)
    chunk.bind_params()
    chunk.opt_tier = opt_tier
    mine = init[chunk.lo:chunk.hi]

    if plan.resident:
        chunk.param_shard = chunk.shard_of_full()
    else:
        alloc(State.PARAM)
        store.put(chunk.key(State.PARAM), mine)
        chunk.free_full()
    if State.MASTER in layout:
        alloc(State.MASTER)
        store.put(chunk.key(State.MASTER), mine)
    else:
        chunk.master = chunk.param_shard
        chunk.master_in_param = True
    for state in (State.GRAD, State.GRAD_SPARE, State.PENDING, State.EXP_AVG, State.EXP_AVG_SQ):
        if state in layout:
            alloc(state)
    step_device = torch.device("cpu") if opt_tier == NVME else chunk.master.device
    chunk.step = torch.zeros((), dtype=torch.float32, device=step_device)
    return chunk
