"""The memory planner's view of a model: each distinct pipeline stage as one rank of the planned mesh sees it,
built on the meta device exactly as the trainer builds it under --deepspeed (ptm_planner.plan)."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import mesh_sizes
from megatron.core.transformer_config import TransformerConfig
from megatron.model.gpt_model import GPTModel


@dataclass(frozen=True)
class Mesh:
    nproc_per_node: int
    nnodes: int
    tp: int
    pp: int

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def dp(self) -> int:
        return mesh_sizes(self.world, self.tp, self.pp)


@dataclass
class StageModel:
    """One pipeline stage's parameters as the trainer hands them to the engine (meta tensors)."""
    stage: int
    named: list[tuple[str, nn.Parameter]]
    group_of: dict[int, int]
    isolated: set[int]
    num_layers: int
    layer_weights: int  # elements of one transformer layer's matrices on this rank
    layer_matrix: int  # elements of the layer's largest matrix on this rank (the smallest useful page)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)


@contextlib.contextmanager
def _as_mesh_rank(mesh: Mesh, stage: int):
    """Pose as global rank (pipeline stage ``stage``, DP 0, TP 0) of ``mesh`` inside this one process.

    torch's "fake" process group gives a rank of a world of any size without other processes (every
    collective is a no-op), so megatron.core.parallel_state builds the real mesh and the model layers
    read their real tensor/pipeline ranks and sizes.
    """
    if dist.is_initialized():
        raise RuntimeError("the memory planner poses as one rank of the planned mesh; run it in a process "
                           "without torch.distributed initialised (e.g. python tools/plan_memory.py)")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    rank = stage * mesh.dp * mesh.tp  # Megatron's order: tp fastest, then dp, then pp
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=mesh.world)
    try:
        ps.initialize_model_parallel(mesh.tp, mesh.pp)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def build_stage(model_cfg: TransformerConfig, mesh: Mesh, stage: int) -> StageModel:
    """The stage's parameters, in the order the trainer's model registers them (fp32, as under --deepspeed).

    The model is built on the meta device with one transformer layer per stage; that layer's parameters
    are then repeated for the stage's other layers (every layer has the same shapes), so planning a model
    of thousands of layers costs no more than one of a few.
    """
    one_layer = dataclasses.replace(model_cfg, num_layers=mesh.pp, precision="fp32")
    with _as_mesh_rank(mesh, stage), torch.device("meta"):
        module = GPTModel(one_layer)
        shared = module.shared_embedding_weight()
    built = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    prefix = "decoder.layers.0."
    first = next(i for i, (n, _) in enumerate(built) if n.startswith(prefix))
    layer = [(n[len(prefix):], p) for n, p in built if n.startswith(prefix)]
    per_stage = model_cfg.num_layers // mesh.pp
    layers = [(f"decoder.layers.{j}.{n}", p if j == 0 else nn.Parameter(torch.empty(p.shape, device="meta")))
              for j in range(per_stage) for n, p in layer]
    named = built[:first] + layers + built[first + len(layer):]
    # Param groups exactly as megatron/training/backends/zero.py ZeroBackend gives them to the engine:
    # group 0 = matrices (weight decay), group 1 = biases and norms; the tied embedding copy of a
    # pipelined model gets a chunk of its own (tied_param_groups).
    group_of = {id(p): 0 if p.ndim >= 2 else 1 for _, p in named}
    isolated = {id(shared)} if shared is not None else set()
    matrices = [p.numel() for _, p in layer if p.ndim >= 2]
    return StageModel(stage, named, group_of, isolated, per_stage, sum(matrices), max(matrices))


def representative_stages(pp: int) -> list[int]:
    """Pipeline stages with distinct parameter sets: the first, one middle stage, the last."""
    return sorted({0, min(1, pp - 1), pp - 1})
