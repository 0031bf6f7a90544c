"""Process-group registry for the tensor x context x data x pipeline mesh, with expert parallelism inside data
parallelism.

Rank order follows Megatron-LM: tensor-parallel ranks are adjacent (fastest
varying), then context-parallel, then data-parallel, then pipeline stages:

    global_rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

Context-parallel (CP) ranks split each sequence and hold the same weights, so
gradients are reduced (and ZeRO-sharded) over data x context parallelism
(``get_data_parallel_group(with_context_parallel=True)``), while the data
loader and the loss average see the data-parallel ranks only.

Expert parallelism (EP) splits each data-parallel group into blocks of EP
adjacent data-parallel ranks (Megatron-core's order): within a block the
experts are divided (``ep_rank = dp_rank % EP``) and tokens travel by
all-to-all; ranks holding the same experts (``dp_rank // EP`` differs) form the
expert-data-parallel group, over which expert gradients are reduced. Experts
are tensor-parallel over the same TP group as the dense layers.

This module holds the only mutable global state of the trainer: the groups are
created once per process by :func:`initialize_model_parallel` and then looked up.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist


class ParallelConfigError(ValueError):
    """A mesh or batch size that cannot work; the message says how to fix it."""


@dataclass
class _Groups:
    tp: int
    pp: int
    dp: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup  # ranks that split one sequence
    dp_cp_group: dist.ProcessGroup  # data x context: where gradients of replicated weights are reduced
    pp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # tp x pp: everything that holds a different part of one model replica
    embedding_group: dist.ProcessGroup | None  # first + last stage of this pipeline (tied embeddings)
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of this rank's pipeline, stage order
    dp_ranks: list[int] = field(default_factory=list)
    tp_ranks: list[int] = field(default_factory=list)
    cp_ranks: list[int] = field(default_factory=list)
    dp_cp_ranks: list[int] = field(default_factory=list)
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None  # ranks that split the experts (and exchange tokens)
    expert_dp_group: dist.ProcessGroup | None = None  # ranks that hold the same experts
    expert_mp_group: dist.ProcessGroup | None = None  # tp x pp x ep: every rank holding other expert weights
    ep_ranks: list[int] = field(default_factory=list)


_GROUPS: _Groups | None = None


def mesh_sizes(world_size: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
               context_parallel_size: int = 1) -> int:
    """Return the data-parallel size, or raise a clear error when the mesh does not divide the world."""
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if tp < 1 or pp < 1 or cp < 1:
        raise ParallelConfigError(f"--tensor-model-parallel-size ({tp}), --pipeline-model-parallel-size ({pp}) and "
                                  f"--context-parallel-size ({cp}) must be >= 1")
    if world_size % (tp * pp * cp) != 0:
        what = f"tensor-parallel size {tp} x pipeline-parallel size {pp}" + (
            f" x context-parallel size {cp}" if cp > 1 else "")
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by {what} = {tp * pp * cp}; launch a multiple of "
            f"{tp * pp * cp} processes or change the parallel sizes")
    return world_size // (tp * pp * cp)


def check_expert_parallel_size(expert_model_parallel_size: int, data_parallel_size: int) -> None:
    ep = expert_model_parallel_size
    if ep < 1 or data_parallel_size % ep:
        raise ParallelConfigError(
            f"--expert-model-parallel-size {ep} must divide the data-parallel size {data_parallel_size} (experts "
            "are split inside data parallelism); launch more ranks or choose a divisor")


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              timeout: datetime.timedelta | None = None, expert_model_parallel_size: int = 1,
                              context_parallel_size: int = 1) -> None:
    """Create every process group of the mesh. All ranks must call this, in the same order."""
    global _GROUPS
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before initialize_model_parallel()")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    cp = context_parallel_size
    dp = mesh_sizes(world, tp, pp, cp)
    check_expert_parallel_size(ep, dp)
    if ep > 1 and cp > 1:
        raise ParallelConfigError("expert parallelism with context parallelism is not supported; use "
                                  "--expert-model-parallel-size 1 or --context-parallel-size 1")
    kw = {"timeout": timeout} if timeout is not None else {}

    def rank_of(p: int, d: int, t: int, c: int = 0) -> int:
        return p * dp * cp * tp + d * cp * tp + c * tp + t

    found: dict[str, tuple[dist.ProcessGroup | None, list[int]]] = {}

    def make(name: str, ranks: list[int]) -> None:
        group = dist.new_group(ranks, **kw)  # collective over the world: every rank creates every group
        if rank in ranks:
            found[name] = (group, ranks)

    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                make("tp", [rank_of(p, d, t, c) for t in range(tp)])
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                make("cp", [rank_of(p, d, t, c) for c in range(cp)])
    for p in range(pp):
        for t in range(tp):
            for c in range(cp):
                make("dp", [rank_of(p, d, t, c) for d in range(dp)])
            make("dp_cp", [rank_of(p, d, t, c) for d in range(dp) for c in range(cp)])
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                make("pp", [rank_of(p, d, t, c) for p in range(pp)])
    for d in range(dp):
        for c in range(cp):
            make("mp", [rank_of(p, d, t, c) for p in range(pp) for t in range(tp)])
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                if pp > 1:
                    make("emb", [rank_of(0, d, t, c), rank_of(pp - 1, d, t, c)])

    if ep > 1:
        for p in range(pp):
            for t in range(tp):
                for block in range(dp // ep):
                    make("ep", [rank_of(p, block * ep + e, t) for e in range(ep)])
                for e in range(ep):
                    make("edp", [rank_of(p, b * ep + e, t) for b in range(dp // ep)])
        for block in range(dp // ep):
            make("emp", [rank_of(p, block * ep + e, t) for p in range(pp) for e in range(ep) for t in range(tp)])

    emb = found.get("emb", (None, []))[0]
    _GROUPS = _Groups(tp=tp, pp=pp, dp=dp, tp_group=found["tp"][0], dp_group=found["dp"][0],
                      cp_group=found["cp"][0], dp_cp_group=found["dp_cp"][0],
                      pp_group=found["pp"][0], mp_group=found["mp"][0], embedding_group=emb,
                      pp_ranks=found["pp"][1], dp_ranks=found["dp"][1], tp_ranks=found["tp"][1],
                      cp_ranks=found["cp"][1], dp_cp_ranks=found["dp_cp"][1], ep=ep)
    if ep > 1:
        _GROUPS.ep_group, _GROUPS.ep_ranks = found["ep"]
        _GROUPS.expert_dp_group = found["edp"][0]
        _GROUPS.expert_mp_group = found["emp"][0]
    else:  # every rank holds every expert: the expert groups are the dense ones
        _GROUPS.ep_ranks = [rank]
        _GROUPS.expert_dp_group, _GROUPS.expert_mp_group = _GROUPS.dp_cp_group, _GROUPS.mp_group


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def destroy_model_parallel() -> None:
    global _GROUPS
    _GROUPS = None


def _g() -> _Groups:
    if _GROUPS is None:
        raise RuntimeError("model parallel groups are not initialised; call initialize_model_parallel() first")
    return _GROUPS


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _g().tp_group


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The ranks that see different samples; ``with_context_parallel``: and those that see other parts of the
    same samples (where gradients of replicated weights are reduced)."""
    return _g().dp_cp_group if with_context_parallel else _g().dp_group


def get_context_parallel_group() -> dist.ProcessGroup:
    return _g().cp_group


def get_context_parallel_world_size() -> int:
    return len(_g().cp_ranks)


def get_context_parallel_rank() -> int:
    return _g().cp_ranks.index(dist.get_rank())


def get_context_parallel_global_ranks() -> list[int]:
    return list(_g().cp_ranks)


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _g().pp_group


def get_model_parallel_group() -> dist.ProcessGroup:
    return _g().mp_group


def get_embedding_group() -> dist.ProcessGroup | None:
    return _g().embedding_group


def get_tensor_model_parallel_world_size() -> int:
    return _g().tp


def get_pipeline_model_parallel_world_size() -> int:
    return _g().pp


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return len(_g().dp_cp_ranks) if with_context_parallel else _g().dp


def get_tensor_model_parallel_rank() -> int:
    return _g().tp_ranks.index(dist.get_rank())


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return get_data_parallel_global_ranks(with_context_parallel).index(dist.get_rank())


def get_data_parallel_global_ranks(with_context_parallel: bool = False) -> list[int]:
    return list(_g().dp_cp_ranks if with_context_parallel else _g().dp_ranks)


def get_pipeline_model_parallel_rank() -> int:
    return _g().pp_ranks.index(dist.get_rank())


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == _g().pp - 1


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _g().pp_ranks
    return ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _g().pp_ranks
    return ranks[(ranks.index(dist.get_rank()) - 1) % len(ranks)]


def get_expert_model_parallel_world_size() -> int:
    return _g().ep


def get_expert_model_parallel_rank() -> int:
    return _g().ep_ranks.index(dist.get_rank())


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    """The ranks that split the experts and exchange tokens (None with one such rank)."""
    return _g().ep_group


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """The ranks that hold the same experts: their gradients are reduced (and ZeRO-sharded) over it."""
    return _g().expert_dp_group


def get_expert_data_parallel_world_size() -> int:
    return _g().dp // _g().ep


def get_expert_model_parallel_and_model_parallel_group() -> dist.ProcessGroup:
    """tp x pp x ep: where the expert gradients' squared norm is summed (the dense one over tp x pp)."""
    return _g().expert_mp_group
