"""The memory planner's view of a model: each distinct pipeline stage as one rank of the planned mesh sees it,
built on the meta device exactly as the trainer builds it under --deepspeed (ptm_planner.plan).

A mixture of experts: the rank holds E / EP experts of every MoE layer (the parameters Megatron-core marks
``allreduce = False``, ``is_expert_param``); they form a param group of their own, sharded by ZeRO over the
expert-data-parallel group (DP / EP ranks), while every other parameter, the router included, is sharded
over the whole DP group, as megatron/training/backends/zero.py gives them to the engine."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.distributed.data_parallel import is_expert_param
from megatron.core.parallel_state import check_expert_parallel_size, mesh_sizes
from megatron.core.transformer_config import TransformerConfig
from megatron.model.gpt_model import GPTModel

# Param groups as the trainer gives them to the engine: matrices (weight decay), biases and norms, experts.
DECAY_GROUP, NO_DECAY_GROUP, EXPERT_GROUP = 0, 1, 2
_LAYER = "decoder.layers.0."  # the one transformer layer of a stage built with one


@dataclass(frozen=True)
class Mesh:
    nproc_per_node: int
    nnodes: int
    tp: int
    pp: int
    ep: int = 1  # expert-parallel size: splits the experts inside each data-parallel group
    cp: int = 1  # context-parallel size: ranks that split every sequence (same weights)

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def dp(self) -> int:
        """Ranks that see different samples (the data loader's and the loss's data parallelism)."""
        model_replicas = mesh_sizes(self.world, self.tp, self.pp)
        if model_replicas % self.cp:
            raise ValueError(f"world size {self.world} is not divisible by tensor-parallel size {self.tp} x "
                             f"pipeline-parallel size {self.pp} x context-parallel size {self.cp}; launch a multiple "
                             f"of {self.tp * self.pp * self.cp} processes or change the parallel sizes")
        return model_replicas // self.cp

    @property
    def shard_dp(self) -> int:
        """Ranks that hold the same weights, over which ZeRO shards the states: data x context parallelism."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks that hold the same experts: ZeRO shards the expert states over them."""
        check_expert_parallel_size(self.ep, self.dp)
        return self.shard_dp // self.ep

    @property
    def node_shard_dp(self) -> int:
        """Members of a data x context group on one node: Megatron's order puts tensor parallelism fastest, then
        context and data, so a node of ``nproc_per_node`` ranks holds ``nproc_per_node / tp`` of them (all of
        them when the group fits in a node)."""
        return max(1, min(self.shard_dp, self.nproc_per_node // self.tp))

    def group_dp_sizes(self, dense_shard: int = 0) -> list[int]:
        """Ranks each param group is sharded over (DECAY_GROUP, NO_DECAY_GROUP, EXPERT_GROUP); ``dense_shard``:
        the dense groups' MiCS shard group (0: the whole data x context group)."""
        dense = dense_shard or self.shard_dp
        return [dense, dense, self.expert_dp]


@dataclass
class StageModel:
    """One pipeline stage's parameters as the trainer hands them to the engine (meta tensors)."""
    stage: int
    named: list[tuple[str, nn.Parameter]]
    group_of: dict[int, int]
    isolated: set[int]
    num_layers: int
    layer_weights: int  # elements of one transformer layer's matrices on this rank (the largest layer)
    layer_matrix: int  # elements of the layer's largest matrix on this rank (the smallest useful page)
    moe_layers: int = 0  # layers of this stage with an MoE MLP
    expert_numel: int = 0  # elements of the experts this rank holds (E / EP of each MoE layer)
    active_expert_numel: int = 0  # of those, what one token computes with: top-k experts of each MoE layer

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)

    @property
    def active_numel(self) -> int:
        """Parameters one token computes with on this rank (FLOPs): all but the experts, and top-k of those."""
        return self.numel - self.expert_numel + self.active_expert_numel


@contextlib.contextmanager
def _as_mesh_rank(mesh: Mesh, stage: int):
    """Pose as global rank (pipeline stage ``stage``, DP 0, TP 0) of ``mesh`` inside this one process.

    torch's "fake" process group gives a rank of a world of any size without other processes (every
    collective is a no-op), so megatron.core.parallel_state builds the real mesh and the model layers
    read their real tensor/pipeline ranks and sizes. Context-parallel ranks hold the same weights as
    data-parallel ones, so the mesh is built with them as data parallelism (the order of ranks is the same).
    """
    if dist.is_initialized():
        raise RuntimeError("the memory planner poses as one rank of the planned mesh; run it in a process "
                           "without torch.distributed initialised (e.g. python tools/plan_memory.py)")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    rank = stage * mesh.shard_dp * mesh.tp  # Megatron's order: tp fastest, then cp, dp, then pp
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=mesh.world)
    try:
        ps.initialize_model_parallel(mesh.tp, mesh.pp, expert_model_parallel_size=mesh.ep)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _one_layer_per_stage(model_cfg: TransformerConfig, mesh: Mesh, stage: int, moe: bool):
    """The stage's model built with one transformer layer, dense or MoE: its trainable parameters, that layer's
    (names relative to the layer) and the tied embedding copy it holds (None: none)."""
    layer_moe = dataclasses.replace(model_cfg.moe, layer_freq=1) if moe else None
    one_layer = dataclasses.replace(model_cfg, num_layers=mesh.pp, precision="fp32", moe=layer_moe)
    with _as_mesh_rank(mesh, stage), torch.device("meta"):
        module = GPTModel(one_layer)
        shared = module.shared_embedding_weight()
    built = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    layer = [(n[len(_LAYER):], p) for n, p in built if n.startswith(_LAYER)]
    return built, layer, shared


def stage_layer_ids(num_layers: int, pp: int, stage: int, virtual_stages: int = 1) -> list[int]:
    """Global indices of the layers pipeline stage ``stage`` holds: one run of layers, or with the interleaved
    schedule (``virtual_stages`` v > 1) v model chunks spread along the depth, chunk k the (k * PP + stage)-th."""
    chunk = num_layers // (pp * virtual_stages)
    return [(k * pp + stage) * chunk + i for k in range(virtual_stages) for i in range(chunk)]


def build_stage(model_cfg: TransformerConfig, mesh: Mesh, stage: int, virtual_stages: int = 1) -> StageModel:
    """The stage's parameters, in the order the trainer's model registers them (fp32, as under --deepspeed).

    The model is built on the meta device with one transformer layer per stage (and once more with an MoE
    layer, when the model has them); the stage's layers repeat those parameters (every dense layer has the same
    shapes, and every MoE layer), so planning a model of thousands of layers costs no more than one of a few.
    """
    built, dense, shared = _one_layer_per_stage(model_cfg, mesh, stage, moe=False)
    first = next(i for i, (n, _) in enumerate(built) if n.startswith(_LAYER))
    per_stage = model_cfg.num_layers // mesh.pp
    is_moe = [model_cfg.is_moe_layer(i) for i in stage_layer_ids(model_cfg.num_layers, mesh.pp, stage, virtual_stages)]
    kinds = {False: dense}
    if any(is_moe):
        kinds[True] = _one_layer_per_stage(model_cfg, mesh, stage, moe=True)[1]
    layers, group_of = [], {}
    for j, moe in enumerate(is_moe):
        for n, p in kinds[moe]:
            q = nn.Parameter(torch.empty(p.shape, device="meta"))
            layers.append((f"decoder.layers.{j}.{n}", q))
            group_of[id(q)] = EXPERT_GROUP if is_expert_param(p) else DECAY_GROUP if p.ndim >= 2 else NO_DECAY_GROUP
    named = built[:first] + layers + built[first + len(dense):]
    # Param groups as the trainer gives them to the engine (megatron/training/backends/zero.py ZeroBackend):
    # matrices (weight decay), biases and norms, and the experts over their own shard group; the tied embedding
    # copy of a pipelined model gets a chunk of its own (tied_param_groups).
    for _, p in built[:first] + built[first + len(dense):]:
        group_of[id(p)] = DECAY_GROUP if p.ndim >= 2 else NO_DECAY_GROUP
    isolated = {id(shared)} if shared is not None else set()
    matrices = [[p.numel() for _, p in layer if p.ndim >= 2] for layer in kinds.values()]
    experts = {moe: sum(p.numel() for _, p in layer if is_expert_param(p)) for moe, layer in kinds.items()}
    moe_layers = sum(is_moe)
    expert_numel = moe_layers * experts.get(True, 0)
    local_experts = model_cfg.moe.num_experts // mesh.ep if moe_layers else 1
    active = expert_numel // local_experts * model_cfg.moe.router_topk if moe_layers else 0
    return StageModel(stage, named, group_of, isolated, per_stage, max(map(sum, matrices)), max(map(max, matrices)),
                      moe_layers, expert_numel, active)


def representative_stages(model_cfg: TransformerConfig, pp: int, virtual_stages: int = 1) -> list[int]:
    """Pipeline stages with distinct parameter sets: the first, the last, and of the middle stages one per
    pattern of MoE and dense layers (one for a dense model)."""
    out, patterns = {0, pp - 1}, set()
    for stage in range(1, pp - 1):
        pattern = tuple(map(model_cfg.is_moe_layer, stage_layer_ids(model_cfg.num_layers, pp, stage, virtual_stages)))
        if pattern not in patterns:
            patterns.add(pattern)
            out.add(stage)
    return sorted(out)
