"""ZB-H1, the zero-bubble schedule with 1F1B's activation memory (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024), on one pipeline rank, as rounds (``rounds.py``).

Each backward is split in two: B computes the input gradient, which is all the previous stage waits for, and W
the weight gradients, which nobody waits for. The forwards, the Bs and every exchange are 1F1B's
(``one_f_one_b.py``), so the pipeline moves the same tensors in the same order; the Ws are placed in the time
1F1B spends waiting:

- in the steady phase, rank r keeps up to r weight passes pending and runs the oldest one once it has more. The
  last stage, which holds one activation under 1F1B, keeps the most; the first, which holds p, runs each W as
  soon as the next B is done. Every rank thus holds at most p micro-batches' worth (activations awaiting B plus
  the linear layers' inputs and output gradients awaiting W), the first stage's 1F1B peak.
- in the cool-down, where 1F1B waits for each backward's gradient, one pending W runs while it arrives;
- the remaining Ws close the step, the last micro-batch's last: that pass is the step's last backward.

A W runs between posting a round's exchange and waiting for it, so a rank computes weight gradients while its
neighbours' tensors travel. With the forward, B and W of a micro-batch taking equal time, the bubble is about
4/9 of 1F1B's at p = 4, m = 8 (the paper's handcrafted ZB-H1 reaches 1/3 by letting W memory exceed this bound).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from megatron.core.pipeline_parallel.one_f_one_b import OneFOneBSchedule
from megatron.core.pipeline_parallel.rounds import Round


@dataclass(frozen=True)
class ZeroBubbleH1Schedule(OneFOneBSchedule):
    """ZB-H1 on pipeline rank ``rank`` of ``stages``, ``microbatches`` micro-batches per step, one model chunk."""
    splits_backward: ClassVar[bool] = True

    def pending_weights(self) -> int:
        """Weight passes this rank keeps pending in the steady phase."""
        return self.rank

    def rounds(self, forward_only: bool = False) -> list[Round]:
        rounds = super().rounds(forward_only)
        if forward_only:
            return rounds
        steady = self.total - self.warmup()
        pending: list[int] = []
        out = []
        for r in rounds:
            if r.backward is None:
                out.append(r)
                continue
            pending.append(r.backward)
            if r.backward < steady:
                n = max(0, len(pending) - self.pending_weights())
            else:  # cool-down: one W while the next backward's gradient arrives
                n = 1 if len(pending) > 1 else 0
            out.append(dataclasses.replace(r, weights=tuple(pending[:n])))
            del pending[:n]
        out.append(Round(weights=tuple(pending)))
        return out


def bubble(stages: int, microbatches: int) -> float:
    """ZB-H1's bubble as a fraction of the ideal step, when a forward, an input-gradient and a weight pass take
    one unit each and transfers none: every rank's rounds played at once, each pass starting when its rank is
    free and its input has arrived; the step's length over the ideal 3 m units, minus one (1F1B's is (p - 1) / m)."""
    queues = []
    for rank in range(stages):
        passes = []
        for r in ZeroBubbleH1Schedule(stages, rank, microbatches).rounds():
            passes += [("F", r.forward)] if r.forward is not None else []
            passes += [("B", r.backward)] if r.backward is not None else []
            passes += [("W", k) for k in r.weights]
        queues.append(passes)
    clock, done = [0.0] * stages, {}
    while any(queues):
        for rank, queue in enumerate(queues):
            while queue:
                kind, k = queue[0]
                if kind == "F":
                    ready = done.get(("F", rank - 1, k)) if rank else 0.0
                elif kind == "B":
                    ready = done.get(("B", rank + 1, k)) if rank < stages - 1 else done.get(("F", rank, k))
                else:
                    ready = 0.0
                if ready is None:  # its input comes from a neighbour's pass not played yet
                    break
                clock[rank] = max(clock[rank], ready) + 1
                done[(kind, rank, k)] = clock[rank]
                queue.pop(0)
    return max(clock) / (3 * microbatches) - 1
