"""``--attention-backend``: which kernel of ``torch.nn.functional.scaled_dot_product_attention`` runs attention.

Megatron-LM's names map onto SDPA's kernels: ``flash`` (FlashAttention), ``fused`` (cuDNN, or the
memory-efficient kernel), ``unfused`` and ``local`` (the math kernel, attention written out), ``auto`` (torch
picks per call, the default). Whether the chosen kernel runs for this device, dtype and head size is checked at
start-up with one small attention (forward and backward), so a kernel that does not exist here (``fused`` on a
CPU, ``flash`` in fp32 on a GPU) is one line naming the flag rather than a failure in the first step.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
_KERNELS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
}


class AttentionBackendError(ValueError):
    """The chosen kernel does not run here: printed as one line, exit code 2."""


def attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                      head_dim: int) -> contextlib.AbstractContextManager:
    """A context in which attention runs on kernel ``name``; raises AttentionBackendError when it cannot here."""
    if name == "auto":
        return contextlib.nullcontext()
    kernels = _KERNELS[name]
    q = torch.randn(1, 1, 8, head_dim, device=device, dtype=dtype, requires_grad=True)
    try:
        with sdpa_kernel(kernels), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns once per kernel it rules out, before the error says why
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AttentionBackendError(
            f"--attention-backend {name}: torch has no such attention kernel for {dtype} with head size {head_dim} "
            f"on {device.type} ({reason}); use --attention-backend auto, or one of "
            f"{', '.join(b for b in ATTENTION_BACKENDS if b not in ('auto', name))}") from None
    return sdpa_kernel(kernels)
