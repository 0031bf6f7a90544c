"""``--longest-seq``: the longest sequence a model trains at on a machine, in the lengths its mesh can split.

Memory grows with the sequence (activations and logits linearly, the CPU math kernel's scores quadratically,
learned position embeddings with it), so the search doubles the length from the request's until a plan no
longer fits, then bisects between the last that fits and the first that does not, on multiples of
``seq_step``. "Fits" is the planner's own verdict for the leanest configuration it may choose (ptm_planner.plan:
Planner.feasible, micro-batch 1 and full recompute if needed, any allowed offload of the states).
"""
from __future__ import annotations

from ptm_planner.activations import ActivationLayout
from ptm_planner.plan import Planner, Request, with_seq
from ptm_planner.stages import Mesh

# Beyond this the hardware figures are surely wrong (or the model has no memory to speak of).
LONGEST = 1 << 26


def seq_step(mesh: Mesh, layout: ActivationLayout, strict: bool = False) -> int:
    """Lengths the mesh splits evenly: context parallelism cuts every sequence into 2 x CP chunks, sequence
    parallelism a rank's part into TP pieces (``strict``: what the trainer requires); the search steps in
    multiples of 2 x CP x TP, which every such mesh splits."""
    if not strict:
        return 2 * mesh.cp * mesh.tp
    sp = layout.seq_split(mesh.tp)
    return 2 * mesh.cp * sp if mesh.cp > 1 else sp


def fits(request: Request, seq_length: int) -> bool:
    return Planner(with_seq(request, seq_length)).feasible()


def longest_seq(request: Request) -> int:
    """The largest multiple of ``seq_step`` at which the request fits; 0 when not even one step does."""
    step = seq_step(request.mesh, request.layout)
    lo = max(step, request.model.seq_length // step * step)
    if fits(request, lo):
        hi = 2 * lo
        while fits(request, hi):
            lo, hi = hi, 2 * hi
            if hi > LONGEST:
                raise ValueError(f"the planner found no memory limit below --seq-length {LONGEST}; check the "
                                 f"hardware figures")
    else:
        hi = lo
        while True:
            lo = max(step, hi // 2 // step * step)
            if fits(request, lo):
                break
            if lo == step:
                return 0
            hi = lo
    while hi - lo > step:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(request, mid) else (lo, mid)
    return lo
