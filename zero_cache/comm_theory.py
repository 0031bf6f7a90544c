"""What one optimizer step should communicate under ZeRO, in the unit CommProfiler measures.

The inputs are the engine's own chunk plans, so the figures are exact, padding included. Bytes of a
collective are the full buffer it produces or consumes on this rank (see comm.py); ``B(c)`` below is
chunk c's padded element count times the bytes per element. Per step, on a data-parallel group of N > 1:

- all-gather: a partitioned (stage 3) chunk twice per micro-batch, once before its forward and once before
  its backward; ``B(c)`` in the compute dtype. The reuse rule (``stage3_max_reuse_distance``) may keep a
  chunk gathered between two uses, so the measurement may be lower. A resident chunk (every chunk of
  stages 1 and 2, small stage-3 parameters) is all-gathered once after each applied update, when every
  rank has updated its slice.
- reduce-scatter: stages 2 and 3 reduce every chunk's gradient once per micro-batch, in the compute dtype,
  less the passes a chunk's buffer was held into the next one (``held_passes``, see grad_reducer.py);
  stage 1 sums the micro-batches into fp32 buffers and reduces every chunk once per step, 4 bytes per
  element.
- all-reduce: one, of the gradient's sum of squares and the overflow flag (two float64).
- broadcast: none (the initial weights are broadcast once, at start-up).

With N = 1 there is no peer and nothing is communicated.

This is flat ZeRO-3's step. The hierarchical layouts (docs/zero_cache/hierarchical.md) are measured against it
on purpose: their counts and bytes per kind differ from it by design (the all-reduces of MiCS, the secondary and
the quantized gathers, the quantized all-to-all that qgZ counts as a reduce-scatter).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .comm import CollectiveTotals
from .partition import ChunkPlan

NORM_ALL_REDUCE_BYTES = 2 * 8  # the engine's [sum of squares, non-finite count] in float64
FP32_BYTES = 4


def zero_step_theory(plans: Sequence[ChunkPlan], *, stage: int, element_size: int, dp_size: int,
                     micro_batches: int, param_updates: int,
                     held_passes: Mapping[int, int] | None = None) -> dict[str, CollectiveTotals]:
    """Count and bytes per collective kind for one step.

    element_size: bytes per element of the compute dtype (parameters and stage-2/3 gradients).
    micro_batches: backward passes this step (gradient_accumulation_steps when every micro-batch ran).
    param_updates: times the resident chunks are re-gathered: 1 after an applied update, 0 after a
    skipped (overflowed) one.
    held_passes: chunk index -> backward passes that ended with its gradient buffer held for the next pass
    (stages 2 and 3): that many fewer reduce-scatters of it.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_step_theory: stage must be 1, 2 or 3, got {stage}")
    for name, value, low in (("element_size", element_size, 1), ("dp_size", dp_size, 1),
                             ("micro_batches", micro_batches, 1), ("param_updates", param_updates, 0)):
        if value < low:
            raise ValueError(f"zero_step_theory: {name} must be >= {low}, got {value}")
    if dp_size == 1:
        return {}
    partitioned = [p.padded for p in plans if not p.resident]
    resident = [p.padded for p in plans if p.resident]
    every = partitioned + resident
    gathers = 2 * micro_batches
    all_gather = CollectiveTotals(gathers * len(partitioned) + param_updates * len(resident),
                                  (gathers * sum(partitioned) + param_updates * sum(resident)) * element_size)
    if stage == 1:
        reduce_scatter = CollectiveTotals(len(every), sum(every) * FP32_BYTES)
    else:
        held = held_passes or {}
        saved = sum(held.values())
        saved_elems = sum(n * plans[c].padded for c, n in held.items())
        reduce_scatter = CollectiveTotals(micro_batches * len(every) - saved,
                                          (micro_batches * sum(every) - saved_elems) * element_size)
    return {"all_gather": all_gather, "reduce_scatter": reduce_scatter,
            "all_reduce": CollectiveTotals(1, NORM_ALL_REDUCE_BYTES)}
