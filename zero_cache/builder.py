"""Start-up: pack the model's parameters into chunks and allocate every shard in the store.

Placement rules (one authoritative home per state):
- Partitioned chunk (stage 3): the parameter shard lives on the host with ``offload_param: cpu``, else on
  the device; the full buffer exists only while gathered.
- Resident chunk: the full buffer lives on the device; the parameter shard is a view of it.
- Optimizer tier of a sub-group: host (``offload_optimizer: cpu``) or SSD (``nvme``) except the first
  ``prefetch_cache_sub_group_rate`` share of sub-groups, which stay on the device; else the device.
  fp32 master, gradient shard and Adam moments live there; on the SSD tier the gradient shard stays on
  the host (it is accumulated during backward) and master and moments are page files.
- In fp32 the parameter shard *is* the master (no copy): a partitioned chunk keeps it in the optimizer
  tier (host memory when that tier is SSD), a resident chunk uses its view when the optimizer tier is the
  device or SSD with a CPU compute device. Otherwise a separate fp32 master exists (bf16/fp16, or
  resident chunks whose optimizer is offloaded).
Values are broadcast from DP rank 0 so every replica starts identical.
"""
from __future__ import annotations

import math

import torch

from .comm import Comm
from .config import ZeroCacheConfig
from .partition import ChunkPlan, FlatChunk
from .store import DEVICE, HOST, NVME, ShardStore


def optimizer_tiers(sub_groups: list[list[int]], n_chunks: int, cfg: ZeroCacheConfig) -> list[str]:
    """Tier of each chunk's optimizer state."""
    z = cfg.zero_optimization
    tiers = [DEVICE] * n_chunks
    if z.offload_optimizer.device in ("cpu", "nvme"):
        away = HOST if z.offload_optimizer.device == "cpu" else NVME
        cached = math.ceil(z.prefetch_cache_sub_group_rate * len(sub_groups))
        for k, sg in enumerate(sub_groups):
            for i in sg:
                tiers[i] = DEVICE if k < cached else away
    return tiers


def build_chunk(plan: ChunkPlan, opt_tier: str, store: ShardStore, comm: Comm, cfg: ZeroCacheConfig,
                dtype: torch.dtype, device: torch.device) -> FlatChunk:
    i = plan.index
    # The chunk's initial values, fp32, broadcast so that every DP replica starts identical.
    init = torch.zeros(plan.padded, dtype=torch.float32, device=device)
    for s in plan.slots:
        init[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
    comm.broadcast_from_first(init)

    if plan.resident:
        full = store.allocate(f"c{i}.full", "params", DEVICE, plan.padded, dtype)
    else:
        full = torch.empty(plan.padded, dtype=dtype, device=device)
    full.copy_(init)
    chunk = FlatChunk(plan, comm.rank, full)
    chunk.bind_params()
    chunk.opt_tier = opt_tier
    fp32 = dtype == torch.float32
    mine = init[chunk.lo:chunk.hi]

    if plan.resident:
        chunk.param_shard = chunk.shard_of_full()
    else:
        offload = cfg.zero_optimization.offload_param.device == "cpu"
        tier = opt_tier if fp32 and opt_tier != NVME else (HOST if offload else DEVICE)
        chunk.param_shard = store.allocate(f"c{i}.param", "params", tier, plan.shard, dtype)
        chunk.param_shard.copy_(mine)
        chunk.free_full()

    param_tier = DEVICE if plan.resident else store.tier_of(f"c{i}.param")
    on_ssd = opt_tier == NVME
    if fp32 and (param_tier == opt_tier or (on_ssd and chunk.param_shard.device.type == "cpu")):
        chunk.master = chunk.param_shard
    else:
        chunk.master = store.allocate(f"c{i}.master", "optimizer", opt_tier, plan.shard, torch.float32)
        store.put(f"c{i}.master", mine)
        if on_ssd:
            chunk.swapped.append("master")
    chunk.grad = store.allocate(f"c{i}.grad", "grads", HOST if on_ssd else opt_tier, plan.shard, torch.float32)
    chunk.exp_avg = store.allocate(f"c{i}.exp_avg", "optimizer", opt_tier, plan.shard, torch.float32)
    chunk.exp_avg_sq = store.allocate(f"c{i}.exp_avg_sq", "optimizer", opt_tier, plan.shard, torch.float32)
    if on_ssd:
        chunk.swapped += ["exp_avg", "exp_avg_sq"]
    step_device = torch.device("cpu") if on_ssd else chunk.master.device
    chunk.step = torch.zeros((), dtype=torch.float32, device=step_device)
    return chunk
