"""Forward/backward over the micro-batches of one global batch.

``forward_step_func(data_iterator, model) -> (output, loss_func)`` runs one
micro-batch through this stage; on the last stage ``loss_func(output)`` returns
``(loss, stats)``. Each micro-batch's loss is divided by the number of
micro-batches, so the accumulated gradients are those of the batch mean.

Gradient synchronisation across data-parallel ranks is held back (``no_sync``)
for every backward except the last one of the step, so it happens once per
step and overlaps that last backward.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator

import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import p2p_communication as p2p

ForwardStepFunc = Callable[[Iterator, torch.nn.Module], tuple[torch.Tensor, Callable]]


class _Step:
    """What one stage needs to run a micro-batch forward and backward."""

    def __init__(self, forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int,
                 grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None):
        self.forward_step_func, self.data_iterator, self.model = forward_step_func, data_iterator, model
        self.num_microbatches, self.grad_scale_func = num_microbatches, grad_scale_func
        self.stats: list[dict] = []
        # Auxiliary losses inside the model (MoE routers) get the language-model loss's backward factor.
        scale = grad_scale_func(torch.ones(())) if grad_scale_func is not None else 1.0
        getattr(model, "module", model).set_moe_aux_loss_scale(float(scale) / num_microbatches)

    def forward(self, input_tensor: torch.Tensor | None) -> torch.Tensor:
        getattr(self.model, "module", self.model).set_input_tensor(input_tensor)  # unwrap DDP / ZeRO engine
        output, loss_func = self.forward_step_func(self.data_iterator, self.model)
        if ps.is_pipeline_last_stage():
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


def forward_backward(forward_step_func: ForwardStepFunc, data_iterator, model, *, num_microbatches: int,
                     spec: p2p.TensorSpec, forward_only: bool = False,
                     grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     no_sync: Callable[[], ContextManager] | None = None) -> list[dict]:
    """Run one global batch; returns the loss stats of each micro-batch (on the last stage, else [])."""
    step = _Step(forward_step_func, data_iterator, model, num_microbatches, grad_scale_func)
    no_sync = no_sync or contextlib.nullcontext
    if ps.get_pipeline_model_parallel_world_size() == 1:
        _no_pipelining(step, forward_only, no_sync)
    else:
        _one_f_one_b(step, spec, forward_only, no_sync)
    return step.stats


def _no_pipelining(step: _Step, forward_only: bool, no_sync) -> None:
    for i in range(step.num_microbatches):
        last = i == step.num_microbatches - 1
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            output = step.forward(None)
        if not forward_only:
            with no_sync() if not last else contextlib.nullcontext():
                step.backward(None, output, None)


def _one_f_one_b(step: _Step, spec: p2p.TensorSpec, forward_only: bool, no_sync) -> None:
    """PipeDream-flush 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    m = step.num_microbatches
    warmup = min(ps.get_pipeline_model_parallel_world_size() - ps.get_pipeline_model_parallel_rank() - 1, m)
    steady = m - warmup
    inputs, outputs = [], []
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    backwards_done = 0

    def backward(input_tensor, output_tensor, output_grad):
        nonlocal backwards_done
        backwards_done += 1
        sync = backwards_done == m  # only the step's last backward reduces gradients
        with contextlib.nullcontext() if sync else no_sync():
            return step.backward(input_tensor, output_tensor, output_grad)

    for _ in range(warmup):
        input_tensor = p2p.recv_forward(spec)
        with grad_ctx:
            output = step.forward(input_tensor)
        p2p.send_forward(output, spec)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)

    input_tensor = p2p.recv_forward(spec) if steady > 0 else None
    for i in range(steady):
        last = i == steady - 1
        with grad_ctx:
            output = step.forward(input_tensor)
        if forward_only:
            p2p.send_forward(output, spec)
            input_tensor = None if last else p2p.recv_forward(spec)
            continue
        output_grad = p2p.send_forward_recv_backward(output, spec)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        if last:
            input_tensor = None
            p2p.send_backward(input_grad, spec)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, spec)

    if forward_only:
        return
    for _ in range(warmup):
        output_grad = p2p.recv_backward(spec)
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        p2p.send_backward(input_grad, spec)
