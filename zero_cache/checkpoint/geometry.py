"""Where a rank's flat pieces of state lie inside mesh-independent global tensors.

A parameter a rank holds is a *local* tensor: the whole parameter, or (tensor parallelism) a slice of a larger
*global* tensor, whose place is given by a ``GlobalSlice`` (offset of the local tensor in every dimension).
ZeRO shards a local tensor further into flat element ranges. A flat range of a C-contiguous tensor is a
union of at most ``2 * ndim - 1`` boxes, each contiguous in memory: a partial leading row, whole rows,
a partial trailing row (recursively for the inner dimensions). ``flat_boxes`` computes them; shifted by
the ``GlobalSlice`` offsets they are chunks of the global tensor, the unit the checkpoint stores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GlobalSlice:
    """The place of one local tensor inside its global tensor.

    name: the global tensor's name (mesh-independent: e.g. global layer indices).
    global_shape / offsets: the global tensor's shape and where the local tensor starts in it.
    writes: whether this rank stores it (False for a replica another rank stores, e.g. a tensor-parallel
        replica on tp rank > 0 or the last pipeline stage's copy of a tied embedding).
    resizable_dim: a dimension along which the saved and loading global shapes may differ (the padded
        vocabulary); loading then reads the rows both have. None: the shapes must be equal.
    """
    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    writes: bool = True
    resizable_dim: int | None = None

    @staticmethod
    def whole(name: str, shape: tuple[int, ...]) -> GlobalSlice:
        return GlobalSlice(name, tuple(shape), (0,) * len(shape))


@dataclass(frozen=True)
class Box:
    """A chunk of a tensor that is contiguous in the local tensor's memory.

    flat_lo: its first element in the local tensor's flat order; offsets/sizes: in local coordinates."""
    flat_lo: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def flat_hi(self) -> int:
        return self.flat_lo + self.numel

    def shifted(self, by: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(o + b for o, b in zip(self.offsets, by))


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Elements [lo, hi) of a C-contiguous tensor of ``shape`` as contiguous boxes, in flat order."""
    if not 0 <= lo <= hi <= math.prod(shape):
        raise ValueError(f"flat range [{lo}, {hi}) is outside a tensor of shape {tuple(shape)}")
    if lo == hi:
        return []
    if len(shape) == 0:
        return [Box(0, (), ())]
    strides = _strides(shape)

    def rec(dim: int, prefix: tuple[int, ...], base: int, a: int, b: int) -> list[Box]:
        """Boxes of [a, b) within the sub-tensor at ``prefix`` (dims < dim fixed), ``base`` its flat start."""
        rest = shape[dim + 1:]
        if dim == len(shape) - 1:
            return [Box(base + a, prefix + (a,), (b - a,))]
        inner = strides[dim]
        r0, r1 = a // inner, (b - 1) // inner
        if r0 == r1:
            return rec(dim + 1, prefix + (r0,), base + r0 * inner, a - r0 * inner, b - r0 * inner)
        out = []
        first_full, end_full = r0, r1 + 1
        if a % inner:
            out += rec(dim + 1, prefix + (r0,), base + r0 * inner, a % inner, inner)
            first_full = r0 + 1
        if b % inner:
            end_full = r1
        if end_full > first_full:
            out.append(Box(base + first_full * inner, prefix + (first_full,) + (0,) * len(rest),
                           (end_full - first_full,) + tuple(rest)))
        if b % inner:
            out += rec(dim + 1, prefix + (r1,), base + r1 * inner, 0, b % inner)
        return out

    boxes = rec(0, (), 0, lo, hi)
    # rec() leaves the leading fixed dims out of ``sizes``: pad them with ones.
    return [Box(bx.flat_lo, bx.offsets, (1,) * (len(shape) - len(bx.sizes)) + bx.sizes) for bx in boxes]


def split_box(box: Box, shape: tuple[int, ...], max_numel: int) -> list[Box]:
    """``box`` (from ``flat_boxes`` of a tensor of ``shape``) cut into contiguous boxes of at most
    ``max_numel`` elements, along its first dimension longer than one."""
    if box.numel <= max_numel:
        return [box]
    strides = _strides(shape)
    dim = next(d for d, n in enumerate(box.sizes) if n > 1)
    inner = math.prod(box.sizes[dim + 1:])
    out = []
    if inner <= max_numel:
        step = max_numel // inner
        for start in range(0, box.sizes[dim], step):
            n = min(step, box.sizes[dim] - start)
            offsets = box.offsets[:dim] + (box.offsets[dim] + start,) + box.offsets[dim + 1:]
            sizes = box.sizes[:dim] + (n,) + box.sizes[dim + 1:]
            out.append(Box(box.flat_lo + start * strides[dim], offsets, sizes))
        return out
    for j in range(box.sizes[dim]):  # a single row is too large: cut inside each row
        offsets = box.offsets[:dim] + (box.offsets[dim] + j,) + box.offsets[dim + 1:]
        sizes = box.sizes[:dim] + (1,) + box.sizes[dim + 1:]
        out += split_box(Box(box.flat_lo + j * strides[dim], offsets, sizes), shape, max_numel)
    return out
