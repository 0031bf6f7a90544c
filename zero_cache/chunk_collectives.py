"""How the chunks of one shard group are gathered and their gradients reduced, flat or hierarchical.

- Flat ZeRO-3: one all-gather and one reduce-scatter over the shard group.
- MiCS / HSDP (``replicate``): the shard group is a block of the data-parallel group; gradients are
  reduce-scattered inside the block, and the step's accumulated shard is all-reduced across the blocks (the
  members holding the same shard) once, by the gradient reducer at the step.
- hpZ (``node`` with ``secondary``): the first gather of a step runs over the whole shard group; later gathers
  of the same parameters (backward, other micro-batches) all-gather the secondary shards the node's ranks kept,
  over ``node`` only (the coordinator keeps the secondary shards and decides which gather a request gets).
- qwZ (``quantize_weights``): primary gathers send int8 blocks (quantize.py) and dequantize on arrival, this
  rank's own piece included, so every rank computes with the same weights.
- qgZ (``quantize_grads``, with ``node`` and ``cross``): the chunk's gradient buffer is reduce-scattered inside
  the node in its own precision, then each rank sends the pieces of its slice that other hosts own as int4 or
  int8 blocks (``grad_bits``; an all-to-all over ``cross``) and sums what it receives in fp32. With
  ``error_feedback`` each rank keeps, per chunk (the collective's tag names it), what quantizing its slice lost,
  in fp32, and adds it to the slice before quantizing the chunk's next reduction: the error does not pile up over
  the micro-batches and steps, it is carried to the next one (1/L of the chunk's fp32 size per rank, L = node).
- Two hops (``two_hop``, gloo groups that span hosts): a gather runs across hosts first, each rank fetching only
  the pieces of its own place on the other hosts, then inside the node; a reduce-scatter runs inside the node
  first, then across hosts. Each element crosses the host links once per host instead of once per remote rank
  (gloo's point-to-point exchange sends a rank's piece straight to every peer). NCCL picks its own algorithms
  across nodes, so it is not used there.

Every rank of a group issues the same collectives in the same order: which path a chunk takes depends only
on the configuration and on the trace both ranks share.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .comm import Comm, Handle
from .quantize import dequantize_into, packed_nbytes, quantize, quantize_into


class _Then:
    """Wait for ``first``, then run ``then`` (the second hop of a two-level collective, blocking)."""

    def __init__(self, first: Handle, then: Callable[[], None]):
        self._first, self._then = first, then

    def wait(self) -> None:
        if self._then is not None:
            self._first.wait()
            then, self._then = self._then, None
            then()


class ChunkCollectives:
    def __init__(self, shard: Comm, *, replicate: Comm | None = None, node: Comm | None = None,
                 cross: Comm | None = None, secondary: bool = False, quantize_weights: bool = False,
                 quantize_grads: bool = False, block: int = 256, grad_bits: int = 8, two_hop: bool = False,
                 error_feedback: bool = False):
        if (secondary or quantize_grads or two_hop) and (node is None or cross is None):
            raise ValueError("secondary shards, quantized gradients and two-hop collectives need the node and "
                             "cross-node groups")
        self.shard = shard
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.node, self.cross = node, cross
        self.secondary = secondary and node is not None and node.size < shard.size
        self.quantize_weights = quantize_weights and shard.size > 1
        self.quantize_grads = quantize_grads and cross is not None and cross.size > 1
        self.two_hop = two_hop and node.size > 1 and cross.size > 1
        self.residuals: dict[str, torch.Tensor] | None = {} if error_feedback and self.quantize_grads else None
        self.block = block
        self.grad_bits = grad_bits

    @property
    def replicas(self) -> int:
        """Copies of each shard across the data-parallel group (1: flat)."""
        return self.replicate.size if self.replicate is not None else 1

    @property
    def counts_in_norm(self) -> bool:
        """Whether this rank's shards count in the global gradient norm (one replica of each does)."""
        return self.replicate is None or self.replicate.rank == 0

    # ---- parameters ---------------------------------------------------------------------------------------
    def broadcast_init(self, init: torch.Tensor) -> None:
        """Make a chunk's initial values those of the data-parallel group's first rank, on every replica."""
        self.shard.broadcast_from_first(init)
        if self.replicate is not None:
            self.replicate.broadcast_from_first(init)

    def gather(self, out: torch.Tensor, shard: torch.Tensor, tag: str, after=None) -> Handle:
        """Async all-gather of the chunk's shards into ``out`` over the shard group (quantized with qwZ)."""
        if not self.quantize_weights:
            if self.two_hop:
                return self._gather_two_hop(out, shard, tag, after, lambda: None)
            return self.shard.all_gather(out, shard, tag=tag, async_op=True, after=after)
        mine = quantize(shard, self.block)  # queued after ``after``'s work: ordered after it on one stream
        if after is not None:
            after = self.shard.streams.compute_event()
        size, nbytes = self.shard.size, mine.numel()
        packed = torch.empty(size * nbytes, dtype=torch.uint8, device=mine.device)

        def finish():
            for r, piece in enumerate(out.chunk(size)):
                dequantize_into(piece, packed[r * nbytes:(r + 1) * nbytes], self.block)
        if self.two_hop:
            return self._gather_two_hop(packed, mine, tag, after, finish)
        return self.shard.all_gather_packed(packed, mine, finish, tag=tag, after=after)

    def _gather_two_hop(self, gathered: torch.Tensor, mine: torch.Tensor, tag: str, after,
                        finish: Callable[[], None]) -> Handle:
        """``gathered`` (every rank's ``mine``, in rank order) = an all-gather across hosts of the pieces of this
        rank's place, then one inside the node of what that gathered; then ``finish()``."""
        hosts, local, k = self.cross.size, self.node.size, mine.numel()
        across = torch.empty(hosts * k, dtype=mine.dtype, device=mine.device)
        first = self.cross.all_gather(across, mine, tag=tag, async_op=True, after=after)

        def inside() -> None:
            stacked = torch.empty(local * hosts * k, dtype=mine.dtype, device=mine.device)
            self.node.all_gather(stacked, across, tag=tag)
            # stacked holds [node rank j][host h]; rank h * local + j's piece goes to place h * local + j
            gathered.view(hosts, local, k).copy_(stacked.view(local, hosts, k).transpose(0, 1))
            finish()
        return _Then(first, inside)

    def secondary_range(self, padded: int) -> tuple[int, int]:
        """The elements of a chunk this rank keeps as its secondary shard."""
        piece = padded // self.node.size
        return self.node.rank * piece, (self.node.rank + 1) * piece

    def gather_secondary(self, out: torch.Tensor, secondary: torch.Tensor, tag: str, after=None) -> Handle:
        """Async all-gather of the node's secondary shards into ``out`` (exact)."""
        return self.node.all_gather(out, secondary, tag=tag, async_op=True, after=after)

    # ---- gradients ----------------------------------------------------------------------------------------
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str) -> Handle:
        """Async: ``out`` = the sum over the shard group of this rank's shard of ``full`` (over the data-parallel
        group, but for MiCS replicas, which the gradient reducer sums at the step)."""
        if self.quantize_grads or self.two_hop:
            return self._reduce_scatter_two_hop(out, full, tag)
        return self.shard.reduce_scatter(out, full, tag=tag, async_op=True)

    def _reduce_scatter_two_hop(self, out: torch.Tensor, full: torch.Tensor, tag: str) -> Handle:
        """Inside the node, then across hosts: exact, or (qgZ) as int4/int8 blocks summed in fp32 on arrival."""
        hosts, local = self.cross.size, self.node.size
        piece = full.numel() // (hosts * local)
        # Shard r = h * local + j belongs to host h's j-th rank. Reordered so that node rank j's slice holds the
        # shards of every host's j-th rank, the node's reduce-scatter leaves each rank the pieces its cross-node
        # peers own, in host order.
        order = full if local == 1 else full.view(hosts, local, piece).transpose(0, 1).contiguous().view(-1)
        mid = torch.empty(hosts * piece, dtype=full.dtype, device=full.device)
        first = self.node.reduce_scatter(mid, order, tag=tag, async_op=True)

        def exact() -> None:
            self.cross.reduce_scatter(out, mid, tag=tag)

        def quantized() -> None:
            nbytes = packed_nbytes(piece, self.block, self.grad_bits)
            send = torch.empty((hosts, nbytes), dtype=torch.uint8, device=full.device)
            src = mid if self.residuals is None else self._with_residual(tag, mid)
            for h in range(hosts):
                quantize_into(send[h], src[h * piece:(h + 1) * piece], self.block, self.grad_bits)
            if self.residuals is not None:  # what this quantization lost goes into the next one
                for h in range(hosts):
                    dequantize_into(src[h * piece:(h + 1) * piece], send[h], self.block, accumulate=False,
                                    bits=self.grad_bits)
                self.residuals[tag].sub_(src)
            recv = torch.empty_like(send)
            self.cross.all_to_all(recv, send, tag=tag)
            acc = out if out.dtype == torch.float32 else torch.empty(piece, dtype=torch.float32, device=out.device)
            for h in range(hosts):
                dequantize_into(acc, recv[h], self.block, accumulate=h > 0, bits=self.grad_bits)
            if acc is not out:
                out.copy_(acc)
        return _Then(first, quantized if self.quantize_grads else exact)

    def _with_residual(self, tag: str, mid: torch.Tensor) -> torch.Tensor:
        """``mid`` plus what quantizing the chunk's last slice lost, in fp32; the residual then holds that sum
        (the caller subtracts what it sends)."""
        residual = self.residuals.get(tag)
        if residual is None:
            residual = self.residuals[tag] = torch.zeros(mid.numel(), dtype=torch.float32, device=mid.device)
        residual.add_(mid)
        return residual.clone()
