"""Weight gradients computed straight into the engine's gradient buffers (gradient-accumulation fusion).

Autograd returns a linear layer's weight gradient, ``grad_output^T @ input``, as a new tensor; the engine's hook
then copies it into its chunk's flat buffer and frees it. For a GPT that is a weight-sized allocation (page
faults, on the CPU) and copy per matrix per micro-batch: about 3.6 GB a step at 1.04B parameters. ``linear``
below hands the two factors to the parameter's sink instead, which multiplies them into the buffer or adds the
product to what the buffer already holds (Megatron-LM's ``gradient_accumulation_fusion`` into ``main_grad``;
the engine's buffers are not persistent, so the sink finds the right one). Any owner of a gradient buffer can
set sinks (Megatron's DistributedDataParallel sets one per ``main_grad``). Without a sink it is ``F.linear``.

``linear`` returns ``None`` as the weight's gradient. Autograd still runs the weight's accumulation node once
per backward pass, after every use of the weight has contributed (the sink calls, and the gradients of any use
outside ``linear``), and the engine's post-accumulate-grad hook there adds whatever ``param.grad`` holds and
counts the parameter as done. So a weight that ``linear`` and other code share gets the sum.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

# (grad_output, input), both 2-D: [tokens, out_features] and [tokens, in_features].
WeightGradSink = Callable[[torch.Tensor, torch.Tensor], None]

_sinks = WeakIdKeyDictionary()  # parameter -> sink; an entry goes with its parameter


def set_weight_grad_sink(param: torch.Tensor, sink: WeightGradSink | None) -> None:
    """Route ``param``'s weight gradient to ``sink`` (None: back to autograd's ``param.grad``)."""
    if sink is None:
        _sinks.pop(param, None)
    else:
        _sinks[param] = sink


def weight_grad_sink(param: torch.Tensor) -> WeightGradSink | None:
    """The sink that takes ``param``'s gradient factors, or None when autograd should produce the gradient."""
    return _sinks.get(param)


def add_product(out: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor, *,
                overwrite: bool = False) -> None:
    """``out += grad_output^T @ inputs`` (``overwrite``: ``out = ...``), the matmul writing into ``out`` when
    the dtypes agree; a 16-bit layer's product is formed first and then added to (or copied into) ``out``."""
    if out.dtype != grad_output.dtype:
        product = grad_output.t().mm(inputs)
        if overwrite:
            out.copy_(product)
        else:
            out.add_(product)
    elif overwrite:
        torch.mm(grad_output.t(), inputs, out=out)
    else:
        out.addmm_(grad_output.t(), inputs)


class _LinearWithWeightGradSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sink: WeightGradSink):
        ctx.save_for_backward(x, weight)
        ctx.sink = sink
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        ctx.sink(grad_2d, x.reshape(-1, x.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fuse: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``fuse`` and a sink for ``weight``, its gradient goes to the sink."""
    sink = weight_grad_sink(weight) if fuse and torch.is_grad_enabled() and weight.requires_grad else None
    if sink is None:
        return F.linear(x, weight, bias)
    return _LinearWithWeightGradSink.apply(x, weight, bias, sink)
