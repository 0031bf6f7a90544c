"""The family of a request: the largest model of it that fits (``--largest``: more layers, or more experts per
MoE layer), the largest size of the start.sh table of its kind that fits, and the ``Plan`` that reports them
with the chosen configuration (ptm_planner.plan)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron.core.moe.config import MoEConfig
from megatron.core.transformer_config import TransformerConfig
from ptm_planner.plan import Evaluation, Option, Planner, Request, with_experts, with_layers
from ptm_planner.sizes import SIZES, ModelSize
from ptm_planner.step_model import StepPrediction

RUNNERS_UP = 4  # candidates --explain shows after the chosen one


@dataclass
class Plan:
    request: Request
    fits: bool
    chosen: Evaluation  # the chosen option (or the leanest one when nothing fits)
    num_parameters: int
    step: StepPrediction | None = None  # the chosen option's predicted step (with an accelerator's profile)
    runners_up: list[tuple[StepPrediction, Evaluation]] = field(default_factory=list)  # the next fastest that fit
    largest_layers: int | None = None  # largest num_layers of this family that fits (None: not computed)
    largest_parameters: int | None = None
    largest_size: str | None = None  # largest start.sh size that fits (computed when the request does not)
    needs: dict[str, dict[str, int]] = field(default_factory=dict)  # option name -> hardware it needs
    largest_experts: int | None = None  # largest --num-experts of this family that fits (--largest-by experts)
    longest_seq: int | None = None  # the longest --seq-length that fits (--longest-seq; None: not computed)


@dataclass(frozen=True)
class Growth:
    """A dimension ``--largest`` grows: the values it takes are multiples of ``step`` from ``first`` on."""
    flag: str
    first: int
    step: int
    current: int  # the request's value
    apply: Callable[[Request, int], Request]


def growth(request: Request, by: str = "layers") -> Growth:
    """How ``--largest-by`` grows the request's family: ``layers`` (multiples of the pipeline size) or, for a
    mixture of experts, ``experts`` per MoE layer (multiples of the expert-parallel size, at least 2 and top-k)."""
    model, mesh = request.model, request.mesh
    if by == "layers":
        if model.moe is not None and not isinstance(model.moe.layer_freq, int):
            raise ValueError("--largest grows --num-layers, and a --moe-layer-freq list fixes the layer count: give "
                             "--moe-layer-freq as an int k, or grow the experts (--largest-by experts)")
        # The interleaved schedule needs whole model chunks on every stage.
        step = mesh.pp * (request.layout.layers_per_virtual_stage or 1)
        return Growth("--num-layers", step, step, model.num_layers, with_layers)
    if by == "experts":
        if model.moe is None:
            raise ValueError("--largest-by experts grows a mixture of experts; give --num-experts")
        least = max(2, model.moe.router_topk)
        return Growth("--num-experts", -(-least // mesh.ep) * mesh.ep, mesh.ep, model.moe.num_experts, with_experts)
    raise ValueError(f"--largest-by {by!r}: use layers or experts")


def largest(request: Request, by: str = "layers") -> int:
    """The largest value of the dimension ``by`` (growth) with which the request's family fits; 0 if none.

    Needs grow about linearly with it: two secant steps on the leanest option's needs give a first guess,
    and a galloping search from there finds the exact boundary.
    """
    g = growth(request, by)
    step = g.step

    def fits(n: int) -> bool:
        return Planner(g.apply(request, n)).feasible()

    def lean_need(n: int) -> dict[str, int]:
        planner = Planner(g.apply(request, n))
        return planner.evaluate(planner.leanest()).need  # with the real budgets: what spills is on disk

    def secant(a: int, b: int) -> int:
        """The value at which the first resource runs out, on the line through the needs at a and b."""
        na, nb = needs.get(a) or lean_need(a), needs.get(b) or lean_need(b)
        needs.update({a: na, b: nb})
        out = [a + (cap[r] - na[r]) * (b - a) // (nb[r] - na[r]) for r in cap if nb[r] > na[r]]
        return max(g.first, min(out, default=g.first) // step * step)

    cap, needs = Planner(g.apply(request, g.first)).capacity(), {}
    first = max(g.first + step, g.current)
    guess = secant(g.first, first)
    start = secant(first, guess) if guess != first else guess
    if fits(start):
        lo, d = start, step
        while fits(lo + d):
            lo, d = lo + d, 2 * d
            if lo > 1 << 20:
                raise ValueError(f"the planner found no memory limit below {g.flag} {1 << 20}; check the hardware "
                                 f"figures")
        hi = lo + d
    else:
        hi, d = start, step
        while True:
            cand = max(g.first, hi - d)
            if fits(cand):
                lo = cand
                break
            if cand == g.first:
                return 0
            hi, d = cand, 2 * d
    while hi - lo > step:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def size_model(request: Request, size: ModelSize) -> TransformerConfig | None:
    """The model of a start.sh size with the request's sequence, vocabulary, precision and MoE settings; None when
    it is not of the request's kind (dense or MoE) or does not split over its mesh."""
    model, mesh = request.model, request.mesh
    if size.is_moe != (model.moe is not None) or size.num_layers % mesh.pp or size.num_attention_heads % mesh.tp:
        return None
    moe = None
    if size.is_moe:
        if size.num_experts % mesh.ep:
            return None
        moe = MoEConfig(num_experts=size.num_experts, router_topk=size.router_topk,
                        ffn_hidden_size=size.moe_ffn_hidden_size,
                        shared_expert_intermediate_size=size.shared_expert_intermediate_size,
                        capacity_factor=model.moe.capacity_factor)
    try:
        return dataclasses.replace(model, num_layers=size.num_layers, hidden_size=size.hidden_size,
                                   num_attention_heads=size.num_attention_heads, ffn_hidden_size=size.ffn_hidden_size,
                                   kv_channels=None, num_query_groups=None, moe=moe)
    except ValueError:
        return None


def largest_size(request: Request) -> str | None:
    """The largest size of the start.sh table, of the request's kind (dense or MoE), that fits the request's mesh,
    sequence, vocabulary and precision."""
    candidates = [(model.num_parameters(), size.name, model) for size in SIZES
                  if (model := size_model(request, size)) is not None]
    for _, name, model in sorted(candidates, key=lambda c: c[0], reverse=True):
        try:
            if Planner(dataclasses.replace(request, model=model)).feasible():
                return name
        except ValueError:  # a size whose shapes the mesh cannot split (e.g. the expert ffn over TP)
            continue
    return None


def plan(request: Request, largest_value: int | None = None, largest_by: str = "layers") -> Plan:
    """Plan ``request``; when it does not fit, also find the largest of its family (``largest_value``: known,
    of the dimension ``largest_by``)."""
    planner = Planner(request)
    chosen = planner.search()
    result = Plan(request, chosen.fits, chosen, request.model.num_parameters(), planner.predict(chosen))
    if request.profile is not None and chosen.fits:
        result.runners_up = [pe for pe in planner.ranked() if pe[1] is not chosen][:RUNNERS_UP]
    if largest_value is not None or not chosen.fits:
        by = largest_by if largest_value is not None else "layers"
        if by == "layers" and request.model.moe is not None and not isinstance(request.model.moe.layer_freq, int):
            by = "experts"  # a --moe-layer-freq list fixes the layer count
        n = largest_value if largest_value is not None else largest(request, by)
        g = growth(request, by)
        if by == "layers":
            result.largest_layers = n
        else:
            result.largest_experts = n
        result.largest_parameters = g.apply(request, n).model.num_parameters() if n else 0
    if not chosen.fits:
        page = planner.pages[0]
        fastest = Option("none", page, request.micro_batch_size, request.recompute_forced,
                         planner.sub_group_sizes(page)[0], schedule=planner.schedules()[0])
        result.largest_size = largest_size(request)
        result.needs = {"no offload": planner.requirements(fastest),
                        "states on SSD": planner.requirements(dataclasses.replace(planner.leanest(), offload="nvme"))}
    return result
