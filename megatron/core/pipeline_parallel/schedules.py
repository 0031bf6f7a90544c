"""Forward/backward over the micro-batches of one global batch.

``forward_step_func(data_iterator, model) -> (output, loss_func)`` runs one
micro-batch through this stage; on the last stage ``loss_func(output)`` returns
``(loss, stats)``. Each micro-batch's loss is divided by the number of
micro-batches, so the accumulated gradients are those of the batch mean.

Without pipelining the micro-batches run one after another. With it, a schedule
object (``PipelineSchedule``) lists each rank's rounds of compute and exchange
with its neighbours, and one loop runs them: PipeDream-flush 1F1B
(``one_f_one_b.py``), or with virtual pipeline stages (the model a
``ModelChunks`` of v chunks) the interleaved 1F1B (``interleaved.py``). Under
interleaving every chunk runs every micro-batch, so ``forward_step_func`` is
handed an iterator per chunk that replays the step's micro-batches, each read
from ``data_iterator`` once.

Each backward pass runs inside the gradient owner's ``backward_pass(last_of_chunk,
last_of_step)`` (``backward_passes.py``): Megatron's DDP holds its all-reduce
back for every backward but each chunk's last of the step, so the reductions
happen once per step and overlap the backwards that follow; the zero_cache
engine is told which pass is the step's last. Under a schedule that splits the
backward (ZB-H1, ``zero_bubble.py``), a backward computes the input gradient
inside the owner's ``deferred_weight_grads`` and its weight gradients run later
(``backward_weights``), while a round's exchange is in flight.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable, Iterator

import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.backward_passes import BackwardPasses, UnownedGradients
from megatron.core.pipeline_parallel.interleaved import InterleavedSchedule
from megatron.core.pipeline_parallel.model_chunks import ModelChunks
from megatron.core.pipeline_parallel.one_f_one_b import OneFOneBSchedule
from megatron.core.pipeline_parallel.rounds import SCHEDULES, PipelineSchedule
from megatron.core.pipeline_parallel.zero_bubble import ZeroBubbleH1Schedule

ForwardStepFunc = Callable[[Iterator, torch.nn.Module], tuple[torch.Tensor, Callable]]


class _ReplayedMicroBatches:
    """The step's micro-batches for each of ``readers`` model chunks, in order: each is read from ``source`` once,
    when the first chunk asks for it, and dropped when the last one has had it."""

    def __init__(self, source: Iterator | None, readers: int):
        self.source, self.readers = source, readers
        self.fetched = 0
        self.pending: dict[int, list[Any]] = {}  # micro-batch index -> [batch, chunks still to read it]

    def _get(self, i: int) -> Any:
        while self.fetched <= i:
            self.pending[self.fetched] = [next(self.source), self.readers]
            self.fetched += 1
        entry = self.pending[i]
        entry[1] -= 1
        if entry[1] == 0:
            del self.pending[i]
        return entry[0]

    def reader(self) -> Iterator | None:
        if self.source is None:
            return None

        def read() -> Iterator:
            i = 0
            while True:
                yield self._get(i)
                i += 1
        return read()


class _Step:
    """What one stage needs to run a micro-batch forward and backward on one of its model chunks."""

    def __init__(self, forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int,
                 grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None):
        self.forward_step_func, self.model = forward_step_func, model
        self.num_microbatches, self.grad_scale_func = num_microbatches, grad_scale_func
        self.stage = getattr(model, "module", model)  # unwrap DDP / ZeRO engine
        self.chunks = self.stage.num_chunks if isinstance(self.stage, ModelChunks) else 1
        if self.chunks > 1:
            replay = _ReplayedMicroBatches(data_iterator, self.chunks)
            self.iterators = [replay.reader() for _ in range(self.chunks)]
        else:
            self.iterators = [data_iterator]
        self.stats: list[dict] = []
        # Auxiliary losses inside the model (MoE routers) get the language-model loss's backward factor.
        scale = grad_scale_func(torch.ones(())) if grad_scale_func is not None else 1.0
        self.stage.set_moe_aux_loss_scale(float(scale) / num_microbatches)

    def forward(self, input_tensor: torch.Tensor | None, chunk: int = 0) -> torch.Tensor:
        if self.chunks > 1:
            self.stage.select(chunk)
        self.stage.set_input_tensor(input_tensor)
        output, loss_func = self.forward_step_func(self.iterators[chunk], self.model)
        if ps.is_pipeline_last_stage() and chunk == self.chunks - 1:
            loss, stats = loss_func(output)
            self.stats.append(stats)
            output = loss / self.num_microbatches
        return output

    def backward(self, input_tensor, output_tensor, output_grad) -> torch.Tensor | None:
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_grad is None and self.grad_scale_func is not None:
            output_tensor = self.grad_scale_func(output_tensor)
        torch.autograd.backward(output_tensor, grad_tensors=output_grad)
        return input_tensor.grad if input_tensor is not None else None


def pipeline_schedule(name: str, stages: int, rank: int, chunks: int, microbatches: int) -> PipelineSchedule:
    """This pipeline rank's schedule ``name`` (one of ``SCHEDULES``)."""
    if name == "interleaved-1f1b":
        return InterleavedSchedule(stages, rank, chunks, microbatches)
    if chunks > 1:
        raise ValueError(f"the {name} schedule runs one model chunk per stage, not {chunks}")
    if name == "zb-h1":
        return ZeroBubbleH1Schedule(stages, rank, microbatches)
    if name == "1f1b":
        return OneFOneBSchedule(stages, rank, microbatches)
    raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")


def forward_backward(forward_step_func: ForwardStepFunc, data_iterator, model, *, num_microbatches: int,
                     spec: p2p.TensorSpec, forward_only: bool = False,
                     grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     passes: BackwardPasses | None = None, schedule: str = "1f1b") -> list[dict]:
    """Run one global batch; returns the loss stats of each micro-batch (on the last stage, else []).
    ``schedule`` names the pipeline schedule (with more than one stage; ``SCHEDULES``)."""
    step = _Step(forward_step_func, data_iterator, model, num_microbatches, grad_scale_func)
    passes = passes or UnownedGradients()
    stages = ps.get_pipeline_model_parallel_world_size()
    if stages == 1:
        _no_pipelining(step, forward_only, passes)
    else:
        plan = pipeline_schedule(schedule, stages, ps.get_pipeline_model_parallel_rank(), step.chunks,
                                 num_microbatches)
        _run_rounds(step, plan, spec, forward_only, passes)
    return step.stats


def _no_pipelining(step: _Step, forward_only: bool, passes: BackwardPasses) -> None:
    for i in range(step.num_microbatches):
        last = i == step.num_microbatches - 1
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            output = step.forward(None)
        if not forward_only:
            with passes.backward_pass(last_of_chunk=last, last_of_step=last):
                step.backward(None, output, None)


def _run_rounds(step: _Step, schedule: PipelineSchedule, spec: p2p.TensorSpec, forward_only: bool,
                passes: BackwardPasses) -> None:
    """Run ``schedule``'s rounds; received tensors wait in per-chunk queues for their turn."""
    chunks = schedule.chunks
    inputs: list[deque] = [deque() for _ in range(chunks)]  # received activations, by chunk, in micro-batch order
    grads: list[deque] = [deque() for _ in range(chunks)]  # received output gradients
    saved: list[deque] = [deque() for _ in range(chunks)]  # (input, output) of forwards awaiting their backward
    weights: dict[int, Any] = {}  # backward -> its weight gradients, kept for a later round (split backward)
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()

    def pass_of(k: int):  # the k-th backward's pass; a split backward's last is its weight pass
        return passes.backward_pass(last_of_chunk=schedule.is_last_backward_of_chunk(k),
                                    last_of_step=k == schedule.total - 1)
    for r in schedule.rounds(forward_only):
        output = input_grad = None
        if r.forward is not None:
            c = schedule.chunk(r.forward)
            input_tensor = inputs[c].popleft() if schedule.input_received(r.forward) else None
            with grad_ctx:
                output = step.forward(input_tensor, c)
            if not forward_only:
                saved[c].append((input_tensor, output))
        if r.backward is not None:
            c = schedule.chunk(r.backward, forward=False)
            input_tensor, output_tensor = saved[c].popleft()
            output_grad = grads[c].popleft() if schedule.grad_received(r.backward) else None
            if schedule.splits_backward:
                with passes.backward_pass(False, False), passes.deferred_weight_grads() as kept:
                    input_grad = step.backward(input_tensor, output_tensor, output_grad)
                weights[r.backward] = kept
            else:
                with pass_of(r.backward):
                    input_grad = step.backward(input_tensor, output_tensor, output_grad)
        exchange = p2p.start_exchange(
            spec, send_next=output if r.send_forward else None, send_prev=input_grad if r.send_backward else None,
            recv_prev=r.recv_forward is not None, recv_next=r.recv_backward is not None)
        for k in r.weights:  # while the neighbours' tensors travel
            with pass_of(k):
                passes.backward_weights(weights.pop(k))
        received, received_grad = exchange.wait()
        if r.recv_forward is not None:
            inputs[r.recv_forward].append(received)
        if r.recv_backward is not None:
            grads[r.recv_backward].append(received_grad)
