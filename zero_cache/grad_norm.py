"""The sum of squares behind the global gradient norm, accurate at the size of a model's gradients."""
from __future__ import annotations

from typing import Sequence

import torch

NormRanges = Sequence[tuple[int, int]] | None  # ranges of a shard counted in the global norm (None: all of it)

# Elements reduced in the tensor's own precision before the partial sums go to float64. Small enough that a
# block's rounding error stays near fp32's epsilon, large enough that the float64 pass is negligible.
_BLOCK = 4096


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``t``'s elements: a float64 scalar on ``t``'s device.

    torch's fp32 norms on CPU accumulate each vector lane in sequence, so their relative error grows with
    the element count (pytorch/pytorch#169237): about 5e-3 at 65M elements, which moves a clipped step.
    Here blocks of ``_BLOCK`` elements are reduced in fp32 (float64 for a float64 tensor) and their sums
    added in float64: about 1e-8 at any size, at the speed of one fp32 norm. A non-finite element makes the
    result non-finite."""
    flat = t.reshape(-1)
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    body = flat.numel() - flat.numel() % _BLOCK
    # The tail (< _BLOCK elements, possibly none) is one more partial sum; an empty one contributes 0.
    partials = torch.cat([torch.linalg.vector_norm(flat[:body].view(-1, _BLOCK), dim=1, dtype=acc),
                          torch.linalg.vector_norm(flat[body:], dtype=acc).reshape(1)])
    return partials.double().square().sum()


def fused_norm_stats(shards: list[torch.Tensor], ranges: list[NormRanges]) -> torch.Tensor:
    """[sum of squares over the counted ranges, 1 if any element is non-finite] of accelerator shards (float64,
    on their device), from one ``torch._foreach_norm`` over all of them: a few kernel launches per step
    instead of several per shard. A GPU reduces each tensor as a tree, so fp32 partial norms stay accurate
    at any size (the CPU's sequential lanes do not: ``sum_of_squares``)."""
    counted: list[torch.Tensor] = []
    partial: list[torch.Tensor] = []  # shards with ranges outside the norm: scanned whole for non-finite values
    for g, r in zip(shards, ranges):
        if r is None:
            counted.append(g)
        else:
            counted += [g[a:b] for a, b in r if b > a]
            partial.append(g)
    norms = torch._foreach_norm(counted + partial)
    squares = torch.stack(norms[:len(counted)]).double().square().sum() if counted else shards[0].new_zeros(
        (), dtype=torch.float64)
    bad = (~torch.stack(norms[len(counted):]).isfinite()).any().double() if partial else squares.new_zeros(())
    return torch.stack([squares, bad])
