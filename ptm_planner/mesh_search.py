"""``ptm-plan --search-parallel``: the split of the job's ranks into tensor x pipeline parallelism (x the given
context and expert parallelism, x data parallelism) whose best fitting configuration has the fewest predicted
seconds per token (step_model.py).

Candidates: TP over the divisors of the processes per node (Megatron keeps a TP group inside a node) that divide
the heads, the query groups and the ffn width; PP over the divisors of the rest that divide the layers (and the
interleaved chunk size, when one is given); with PP > 1 and no chunk size given, also the interleaved schedule
with 2 and 4 model chunks per stage where the layers and the micro-batches allow; CP and EP as requested. Each is
planned as the request itself would be (its own memory plan and choice, the pipeline schedule among them) at the
same global batch (fewer replicas, more micro-batches each), the vocabulary padded for its TP as the trainer pads
it.
"""
from __future__ import annotations

import dataclasses

from megatron.core.parallel_state import ParallelConfigError, check_expert_parallel_size
from megatron.training.config import padded_vocab_size
from ptm_planner.plan import Planner, Request
from ptm_planner.stages import Mesh
from ptm_planner.step_model import StepPrediction


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


VIRTUAL_STAGES = (2, 4)  # model chunks per stage tried for the interleaved schedule


def _interleavings(request: Request, pp: int, micro_batches: int) -> list[int | None]:
    """Layers per model chunk to plan for PP ``pp``: the requested one; else none (one chunk) and every
    VIRTUAL_STAGES split the layers and the micro-batches allow (the interleaved schedule takes a multiple of PP)."""
    given = request.layout.layers_per_virtual_stage
    if given or pp == 1 or request.layout.pipeline_schedule is not None:
        return [given]
    per_stage = request.model.num_layers // pp
    return [None] + [per_stage // v for v in VIRTUAL_STAGES if per_stage % v == 0 and micro_batches % pp == 0]


def splits(request: Request, vocab_size: int) -> list[Request]:
    """The request on every valid TP x PP (x interleaving) split of its ranks (its own split among them)."""
    m, mesh, layout = request.model, request.mesh, request.layout
    out = []
    for tp in _divisors(mesh.nproc_per_node):
        if m.num_attention_heads % tp or m.num_query_groups % tp or m.ffn_hidden_size % tp:
            continue
        for pp in _divisors(mesh.world // tp):
            per_stage = m.num_layers // pp
            if m.num_layers % pp or (layout.layers_per_virtual_stage and per_stage % layout.layers_per_virtual_stage):
                continue
            candidate = Mesh(mesh.nproc_per_node, mesh.nnodes, tp, pp, mesh.ep, mesh.cp)
            try:
                check_expert_parallel_size(candidate.ep, candidate.dp)  # also: the world divides
            except (ParallelConfigError, ValueError):
                continue
            model = dataclasses.replace(m, padded_vocab_size=padded_vocab_size(
                vocab_size, request.make_vocab_size_divisible_by, tp))
            # The same global batch: fewer replicas take more micro-batches each.
            steps = max(1, request.accumulation_steps * mesh.dp // candidate.dp)
            for chunk in _interleavings(request, pp, steps):
                layout = dataclasses.replace(layout, layers_per_virtual_stage=chunk)
                out.append(dataclasses.replace(request, mesh=candidate, model=model, accumulation_steps=steps,
                                               layout=layout))
    return out


def fastest_split(request: Request, vocab_size: int) -> list[tuple[Request, StepPrediction]]:
    """Every split that fits with its best configuration's predicted step, fastest first (empty: none fits).
    Raises ValueError without a profile to predict with."""
    if request.profile is None:
        raise ValueError("--search-parallel ranks splits by predicted speed: plan for GPUs (--device cuda or "
                         "--profile NAME), or give --measure on a CPU plan")
    scored = []
    for candidate in splits(request, vocab_size):
        ranked = Planner(candidate).ranked()
        if ranked:
            scored.append((candidate, ranked[0][0]))
    return sorted(scored, key=lambda rp: rp[1].step_s / rp[1].tokens)
