"""Block-wise int8 / int4 quantization of flat tensors, packed into one byte buffer for a collective.

A flat tensor of ``n`` elements is cut into blocks of ``block`` elements (the last one zero-padded); each block
keeps one fp32 scale, its largest magnitude / L (L = 127 for 8 bits, 7 for 4 bits), and its elements as
round(x / scale) in [-L, L]; 4-bit values are stored two to a byte (offset by 8). The packed layout is
``[values][fp32 scales, one per block]``, so one all-gather or all-to-all of uint8 moves both. The error of one
element is at most half a step, scale / 2 = max|block| / (2 L).

A non-finite element makes its block's scale non-finite, and the whole block dequantizes to non-finite values, so
an overflow stays visible to the loss scaler's check after a quantized reduction.
"""
from __future__ import annotations

import torch

BITS = (8, 4)


def levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def blocks_of(numel: int, block: int) -> int:
    return -(-numel // block)


def _value_bytes(numel: int, block: int, bits: int) -> int:
    return blocks_of(numel, block) * block * bits // 8


def packed_nbytes(numel: int, block: int, bits: int = 8) -> int:
    """Bytes of ``numel`` elements packed: ``bits`` per element (padded to whole blocks), 4 per block's scale."""
    return _value_bytes(numel, block, bits) + 4 * blocks_of(numel, block)


def _scales(packed: torch.Tensor, numel: int, block: int, bits: int) -> torch.Tensor:
    lo = _value_bytes(numel, block, bits)
    return packed[lo:lo + 4 * blocks_of(numel, block)].view(torch.float32)


def quantize_into(packed: torch.Tensor, x: torch.Tensor, block: int, bits: int = 8) -> None:
    """Pack flat ``x`` (any float dtype) into ``packed`` (uint8, ``packed_nbytes(x.numel(), block, bits)``)."""
    n, nb = x.numel(), blocks_of(x.numel(), block)
    top = levels(bits)
    scales = _scales(packed, n, block, bits)
    src = x.reshape(-1).float()
    if nb * block != n:
        src = torch.nn.functional.pad(src, (0, nb * block - n))
    src = src.view(nb, block)
    torch.div(src.abs().amax(dim=1), top, out=scales)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(src / safe[:, None]).clamp_(-top, top)
    values = packed[:_value_bytes(n, block, bits)]
    if bits == 8:
        values.view(torch.int8).view(nb, block).copy_(q)
    else:  # two 4-bit values per byte, each offset by 8 into 1..15
        u = (q + 8).to(torch.uint8).view(-1, 2)
        torch.bitwise_or(u[:, 0], torch.bitwise_left_shift(u[:, 1], 4), out=values)


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, block: int, accumulate: bool = False,
                    bits: int = 8) -> None:
    """``out`` (flat, any float dtype) = (or ``+=`` with ``accumulate``) the values packed in ``packed``."""
    n, nb = out.numel(), blocks_of(out.numel(), block)
    scales = _scales(packed, n, block, bits)
    values = packed[:_value_bytes(n, block, bits)]
    if bits == 8:
        q = values.view(torch.int8).float()
    else:
        q = torch.stack((values & 0x0F, values >> 4), dim=1).float().sub_(8)
    full = (q.view(nb, block) * scales[:, None]).view(-1)[:n]
    if accumulate:
        out.view(-1).add_(full)
    else:
        out.view(-1).copy_(full)


def quantize(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """``x`` packed into a new uint8 buffer on its device."""
    packed = torch.empty(packed_nbytes(x.numel(), block, bits), dtype=torch.uint8, device=x.device)
    quantize_into(packed, x, block, bits)
    return packed
