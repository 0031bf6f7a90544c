"""Point-to-point transfers of activations and gradients between adjacent pipeline stages.

``start_exchange`` posts all its sends and receives together
(``batch_isend_irecv``) and ``Exchange.wait`` waits for them all, so a round's
exchange on one stage and its neighbours' (``rounds.py``: each send meets a
receive) cannot deadlock; between the two a schedule may compute what no
neighbour waits for (weight gradients). Shapes are static:
every micro-batch activation is [micro_batch_size, seq_length, hidden_size].

The next and previous ranks wrap around the pipeline: under the interleaved
schedule the last stage sends its chunk's output to the first stage's next
chunk (``exchange``). With two stages both neighbours are the same rank, so an
activation and a gradient can travel between the same two ranks in one call:
activations (sent to the next stage) and gradients (sent to the previous one)
carry different tags, and every call posts the activation's operations before
the gradient's, so both ends pair them alike however the backend matches them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps

_ACTIVATION_TAG, _GRADIENT_TAG = 1, 2


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class Exchange:
    """A posted exchange; ``wait`` returns (activation received, gradient received) once every operation is done."""
    requests: list
    from_prev: torch.Tensor | None
    from_next: torch.Tensor | None
    sent: list[torch.Tensor]  # kept alive until the sends are done

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for req in self.requests:
            req.wait()
        return self.from_prev, self.from_next


def start_exchange(spec: TensorSpec, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                   recv_prev: bool = False, recv_next: bool = False) -> Exchange:
    """Post the send of ``send_next`` (an activation) to the next stage and of ``send_prev`` (a gradient) to the
    previous one, and the receives of an activation from the previous stage and/or a gradient from the next, in
    one call. The received activation requires grad (its gradient is what the backward sends back)."""
    ops, from_prev, from_next = [], None, None
    group = ps.get_pipeline_model_parallel_group()
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), nxt, group, _ACTIVATION_TAG))
    if recv_prev:
        from_prev = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device, requires_grad=True)
        ops.append(dist.P2POp(dist.irecv, from_prev, prev, group, _ACTIVATION_TAG))
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), prev, group, _GRADIENT_TAG))
    if recv_next:
        from_next = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append(dist.P2POp(dist.irecv, from_next, nxt, group, _GRADIENT_TAG))
    sent = [op.tensor for op in ops if op.op is dist.isend]
    return Exchange(dist.batch_isend_irecv(ops) if ops else [], from_prev, from_next, sent)
