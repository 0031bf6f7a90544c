"""Gradient reduction driven by autograd hooks, so it works however backward is invoked.

Each managed parameter has a post-accumulate-grad hook. It moves the gradient into its chunk's flat
buffer and drops ``param.grad``. Two accumulation modes (see the zero_cache section of README.md):

- ``shard`` (stages 2 and 3, DeepSpeed's way): when every parameter of a chunk has its gradient for the
  current backward pass, the chunk buffer (compute dtype) is reduce-scattered asynchronously and the
  result is added into this rank's fp32 gradient shard. At most ``max_param_reduce_events`` reductions
  are in flight (0 = wait for each at once). Per-step memory: the 4 B/param / N shard plus the buffers
  of the chunks being reduced; communication: one reduce-scatter per chunk per micro-batch.
- ``full`` (stage 1): gradients are summed over micro-batches into full-size fp32 buffers and reduced
  once per step. Memory: 4 B/param unsharded; communication: one reduce-scatter per chunk per step.

The end of every backward pass (an autograd final callback) flushes chunks with only part of their
gradients (unused parameters), waits for the in-flight reductions and lets the coordinator release
gathered chunks. Every backward pass is self-contained, so 1F1B interleaving of micro-batches is fine.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch import nn

from .comm import Comm, group_all_reduce
from .partition import FlatChunk, ParamSlot
from .store import DEVICE, ShardStore


class GradReducer:
    def __init__(self, chunks: list[FlatChunk], comm: Comm, store: ShardStore, *, mode: str, max_events: int,
                 tied_groups: dict[int, object], on_backward_activity: Callable[[], None],
                 on_chunk_done: Callable[[int], None] | None):
        if mode not in ("shard", "full"):
            raise ValueError(f"gradient accumulation mode must be 'shard' or 'full', got {mode!r}")
        self.chunks = chunks
        self.comm = comm
        self.store = store
        self.mode = mode
        self.max_events = max_events
        self.tied_groups = tied_groups  # chunk index -> process group whose members sum this chunk's grads
        self.on_backward_activity = on_backward_activity
        self.on_chunk_done = on_chunk_done
        self.expected = [len(c.plan.slots) for c in chunks]
        self.fired = [0] * len(chunks)
        self.buffers: dict[int, torch.Tensor] = {}
        self.pending: deque = deque()
        self._hooks = []
        for c in chunks:
            for s in c.plan.slots:
                self._hooks.append(s.param.register_post_accumulate_grad_hook(
                    lambda p, c=c.index, s=s: self._on_grad(c, s, p)))

    def _buffer(self, c: int) -> torch.Tensor:
        buf = self.buffers.get(c)
        if buf is None:
            chunk = self.chunks[c]
            if self.mode == "full":
                buf = self.store.allocate(f"c{c}.full_grad", "grads", DEVICE, chunk.plan.padded, torch.float32)
            else:
                buf = torch.zeros(chunk.plan.padded, dtype=chunk.full.dtype, device=chunk.full.device)
            self.buffers[c] = buf
        return buf

    def _on_grad(self, c: int, slot: ParamSlot, param: nn.Parameter) -> None:
        self.on_backward_activity()
        grad = param.grad
        param.grad = None
        self._buffer(c)[slot.offset:slot.offset + slot.numel].add_(grad.reshape(-1))
        self.fired[c] += 1
        if self.fired[c] == self.expected[c]:
            if self.mode == "shard":
                self._reduce(c)
            if self.on_chunk_done is not None:
                self.on_chunk_done(c)

    def _reduce(self, c: int) -> None:
        buf = self.buffers.pop(c)
        out = torch.empty(self.chunks[c].plan.shard, dtype=buf.dtype, device=buf.device)
        handle = self.comm.reduce_scatter(out, buf, tag=f"chunk{c}", async_op=True)
        self.pending.append((c, handle, out, buf))
        while len(self.pending) > self.max_events:
            self._finish()

    def _finish(self) -> None:
        c, handle, out, _buf = self.pending.popleft()
        handle.wait()
        grad = self.chunks[c].grad
        grad.add_(out.to(device=grad.device, dtype=torch.float32), alpha=1.0 / self.comm.size)

    def end_backward(self) -> None:
        """Autograd final callback: reduce partially-filled chunks (in chunk order) and drain."""
        if self.mode == "shard":
            for c in sorted(self.buffers):
                self._reduce(c)
        while self.pending:
            self._finish()
        self.fired = [0] * len(self.chunks)

    def end_step(self) -> None:
        """Before the optimizer step: finish this step's reduction and sum tied gradients across groups."""
        self.end_backward()
        if self.mode == "full":
            for c in sorted(self.buffers):
                buf = self.buffers[c]
                out = torch.empty(self.chunks[c].plan.shard, dtype=torch.float32, device=buf.device)
                self.comm.reduce_scatter(out, buf, tag=f"chunk{c}")
                grad = self.chunks[c].grad
                grad.add_(out.to(grad.device), alpha=1.0 / self.comm.size)
                buf.zero_()
        for c, group in self.tied_groups.items():
            group_all_reduce(self.chunks[c].grad, group, device=self.chunks[c].full.device)
