"""Weight gradients written straight into the engine's gradient buffers (gradient-accumulation fusion).

Autograd returns a weight's gradient as a new tensor; the engine's hook then copies it into its chunk's flat
buffer and frees it. For a GPT that is a weight-sized allocation (page faults, on the CPU) and copy per matrix
per micro-batch, about 3.6 GB a step at 1.04B parameters, and for the embedding table a dense vocabulary-sized
zero-filled tensor that a micro-batch's few hundred tokens touch a few rows of. The layers below hand the
parameter's sink a writer instead: the sink calls it on the right buffer (the engine's buffers are not
persistent, so the sink finds the one in use), and the writer puts the gradient there or adds it to what the
buffer holds, with no gradient tensor in between (Megatron-LM's ``gradient_accumulation_fusion`` into
``main_grad``). Any owner of a gradient buffer can set sinks (Megatron's DistributedDataParallel sets one per
``main_grad``). Without a sink each layer is its ``torch.nn.functional`` counterpart.

- ``linear``: the weight's gradient ``grad_output^T @ input``, multiplied into the buffer.
- ``embedding``: the looked-up rows' gradients, added into their rows of the buffer.

Both return ``None`` as the weight's gradient. Autograd still runs the weight's accumulation node once per
backward pass, after every use of the weight has contributed (the writers, and the gradients of any use
outside these layers), and the engine's post-accumulate-grad hook there adds whatever ``param.grad`` holds and
counts the parameter as done. So a weight that these layers and other code share (a tied embedding and output
layer) gets the sum.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

# Writes a weight's gradient into a buffer of the weight's shape: over what it holds (True) or added to it.
GradWriter = Callable[[torch.Tensor, bool], None]
# Called once per backward of a layer with its weight's writer; calls the writer on the buffer in use.
WeightGradSink = Callable[[GradWriter], None]

_sinks = WeakIdKeyDictionary()  # parameter -> sink; an entry goes with its parameter


def set_weight_grad_sink(param: torch.Tensor, sink: WeightGradSink | None) -> None:
    """Route ``param``'s weight gradient to ``sink`` (None: back to autograd's ``param.grad``)."""
    if sink is None:
        _sinks.pop(param, None)
    else:
        _sinks[param] = sink


def weight_grad_sink(param: torch.Tensor) -> WeightGradSink | None:
    """The sink that takes ``param``'s gradient writer, or None when autograd should produce the gradient."""
    return _sinks.get(param)


def _sink_for(weight: torch.Tensor, fuse: bool) -> WeightGradSink | None:
    """The sink a layer hands ``weight``'s gradient to now: None without ``fuse``, outside autograd, or when
    nobody set one."""
    return weight_grad_sink(weight) if fuse and torch.is_grad_enabled() and weight.requires_grad else None


def add_into(buffer: torch.Tensor) -> WeightGradSink:
    """The sink of a persistent buffer (Megatron's ``main_grad``): every gradient is added to it."""
    return lambda write: write(buffer, False)


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


def add_rows(out: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, *, overwrite: bool = False) -> None:
    """``out[ids[i]] += rows[i]`` for every i, repeated ids summed (``overwrite``: ``out`` zeroed first): the
    embedding table's gradient. ``ids`` is 1-D, ``rows`` [len(ids), embedding_dim], converted to ``out``'s
    dtype. The sum runs in a fixed order on every device, as autograd's embedding backward does."""
    if overwrite:
        out.zero_()
    rows = rows.to(out.dtype)
    if out.device.type == "cpu":
        out.index_add_(0, ids, rows)  # in the order of ids
    else:  # sorted by id on CUDA (index_add_ would use atomics there)
        out.index_put_((ids,), rows, accumulate=True)


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
        x_2d = x.reshape(-1, x.shape[-1])
        ctx.sink(lambda out, overwrite: add_product(out, grad_2d, x_2d, overwrite=overwrite))
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fuse: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``fuse`` and a sink for ``weight``, its gradient goes to the sink."""
    sink = _sink_for(weight, fuse)
    if sink is None:
        return F.linear(x, weight, bias)
    return _LinearWithWeightGradSink.apply(x, weight, bias, sink)


class _EmbeddingWithWeightGradSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, sink: WeightGradSink):
        ctx.save_for_backward(ids)
        ctx.sink = sink
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        ids, = ctx.saved_tensors
        flat_ids, rows = ids.reshape(-1), grad_output.reshape(-1, grad_output.shape[-1])
        ctx.sink(lambda out, overwrite: add_rows(out, flat_ids, rows, overwrite=overwrite))
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, *, fuse: bool = True) -> torch.Tensor:
    """``F.embedding(ids, weight)``; with ``fuse`` and a sink for ``weight``, its gradient goes to the sink."""
    sink = _sink_for(weight, fuse)
    if sink is None:
        return F.embedding(ids, weight)
    return _EmbeddingWithWeightGradSink.apply(ids, weight, sink)
