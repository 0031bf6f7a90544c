"""Block attention that returns its log-sum-exp, and the backward of a block given the FINAL output and LSE.

Ring attention computes attention of the local queries against one key/value block at a time and merges the
partial outputs by their log-sum-exp. Its backward is exact block by block because of the flash-attention
identity: with P = exp(S - lse) and D = rowsum(dout * out), where ``out`` and ``lse`` are those of the whole
row (all blocks merged), dS = P * (dout @ V^T - D) restricted to a block is that block's share of the gradient.
Every kernel here therefore takes ``out`` and ``lse`` from the caller instead of recomputing them.

Shapes: q [b, h, sq, d], k and v [b, h, sk, d] (same head count: the callers repeat grouped key/value heads),
out [b, h, sq, d] in q's dtype, lse [b, h, sq] in float32 (float64 for float64 inputs). ``causal=True`` is the
lower-triangular mask of a diagonal block, so it needs sq == sk. No dropout: ring attention does not support it.

Kernels: torch's fused flash kernel on the CPU; the flash (bf16/fp16) or memory-efficient kernel on CUDA; a
plain fp32-accumulating implementation everywhere else. The fused ops are private ATen ops whose presence and
conventions differ between builds, so the one used for a (device type, dtype) is chosen once by a probe on a
tiny case against the plain implementation, which is also the fallback for shapes a fused op refuses.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

# The memory-efficient kernel pads its LSE along the queries to this block size, and its backward reads it so.
_EFFICIENT_LSE_ALIGN = 32


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attention blocks are [b, h, s, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, heads or head dim "
                         "(repeat grouped key/value heads before calling)")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal block attention needs as many queries as keys (the diagonal block); got "
                         f"{q.shape[2]} and {k.shape[2]}")


def _scale_of(scale: float | None, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else scale


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        upper = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def math_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) computed in fp32 (float64 for float64), materialising the [sq, sk] scores."""
    _check(q, k, v, causal)
    cd = _compute_dtype(q.dtype)
    s = _masked_scores(q.to(cd), k.to(cd), causal, _scale_of(scale, q.shape[-1]))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.to(cd)
    return out.to(q.dtype), lse


def math_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, causal: bool,
                            scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the row's final ``out`` and ``lse``, in fp32 (float64 for float64)."""
    _check(q, k, v, causal)
    cd = _compute_dtype(q.dtype)
    sc = _scale_of(scale, q.shape[-1])
    qf, kf, vf, dof = q.to(cd), k.to(cd), v.to(cd), dout.to(cd)
    p = torch.exp(_masked_scores(qf, kf, causal, sc) - lse.to(cd).unsqueeze(-1))
    delta = (dof * out.to(cd)).sum(dim=-1, keepdim=True)
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    dq = (ds @ kf) * sc
    dk = (ds.transpose(-1, -2) @ qf) * sc
    dv = p.transpose(-1, -2) @ dof
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_cpu_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    return out, lse


def _flash_cpu_backward(dout, q, k, v, out, lse, causal, scale):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        0.0, causal, scale=scale)
    return dq, dk, dv


def _no_dropout_rng() -> tuple[torch.Tensor, torch.Tensor]:
    """The (seed, offset) the CUDA forwards hand to their backward; not read without dropout."""
    return torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)


def _flash_cuda_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale)
    return res[0], res[1][..., : q.shape[2]]


def _flash_cuda_backward(dout, q, k, v, out, lse, causal, scale):
    seed, offset = _no_dropout_rng()
    # None: no cumulative sequence lengths, i.e. dense (not nested/varlen) inputs.
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return dq, dk, dv


def _efficient_cuda_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, scale=scale)
    return res[0], res[1][..., : q.shape[2]]


def _efficient_cuda_backward(dout, q, k, v, out, lse, causal, scale):
    sq = q.shape[2]
    padded = -(-sq // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
    # +inf on the padding rows: exp(s - lse) is 0 there whatever the kernel reads.
    lse = F.pad(lse.float(), (0, padded - sq), value=float("inf")).contiguous()
    seed, offset = _no_dropout_rng()
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), None, out.contiguous(), lse,
        seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


class _Kernel(NamedTuple):
    forward: Forward
    backward: Backward


_KERNELS: dict[str, _Kernel] = {
    "math": _Kernel(math_attention_forward, math_attention_backward),
    "flash_cpu": _Kernel(_flash_cpu_forward, _flash_cpu_backward),
    "flash_cuda": _Kernel(_flash_cuda_forward, _flash_cuda_backward),
    "efficient_cuda": _Kernel(_efficient_cuda_forward, _efficient_cuda_backward),
}


def _candidates(device_type: str, dtype: torch.dtype) -> list[str]:
    """Fused kernels worth probing for this device type and dtype, best first."""
    if device_type == "cpu" and dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        return ["flash_cpu"]
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return ["flash_cuda", "efficient_cuda"]
    if device_type == "cuda" and dtype == torch.float32:
        return ["efficient_cuda"]
    return []


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-8, torch.float32: 1e-4}.get(dtype, 5e-2)


def _agrees(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tol: float) -> bool:
    return all(g.shape == w.shape and torch.allclose(g.double(), w.double(), rtol=tol, atol=tol)
               for g, w in zip(got, want))


def _probe(name: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether fused kernel ``name`` runs here and matches the plain implementation on a tiny case: forward
    (out and lse) and backward given the plain (out, lse), causal and not, the latter with sq != sk."""
    kernel = _KERNELS[name]
    gen = torch.Generator().manual_seed(0)
    tol = _tolerance(dtype)

    def rand(*shape: int) -> torch.Tensor:
        return (0.5 * torch.randn(*shape, generator=gen)).to(device=device_type, dtype=dtype)

    try:
        for sq, sk, causal in ((16, 16, True), (16, 48, False)):
            q, k, v, dout = rand(2, 2, sq, 16), rand(2, 2, sk, 16), rand(2, 2, sk, 16), rand(2, 2, sq, 16)
            out, lse = math_attention_forward(q, k, v, causal, 0.3)
            if not _agrees(kernel.forward(q, k, v, causal, 0.3), (out, lse), tol):
                return False
            want = math_attention_backward(dout, q, k, v, out, lse, causal, 0.3)
            if not _agrees(kernel.backward(dout, q, k, v, out, lse, causal, 0.3), want, tol):
                return False
        return True
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def kernel_name(device_type: str, dtype: torch.dtype) -> str:
    """The kernel used for this device type and dtype: the first fused one that passes the probe, else "math"."""
    with torch.no_grad():
        for name in _candidates(device_type, dtype):
            if _probe(name, device_type, dtype):
                return name
    return "math"


def _fused_or_math(name: str, fused: Callable, plain: Callable, *args) -> tuple[torch.Tensor, ...]:
    """``fused(*args)``, or the plain implementation where the fused op refuses the shape (e.g. a head dim it
    has no build for); running out of memory is not a reason to try the plain one."""
    if name != "math":
        try:
            return fused(*args)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError) as err:
            warnings.warn(f"attention kernel {name} refused a block ({err}); using the plain implementation",
                          stacklevel=3)
    return plain(*args)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: (out [b, h, sq, d] in q's dtype, lse [b, h, sq] fp32, float64 for float64)."""
    _check(q, k, v, causal)
    name = kernel_name(q.device.type, q.dtype)
    return _fused_or_math(name, _KERNELS[name].forward, math_attention_forward, q, k, v, causal, scale)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: bool,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given ``dout`` and the rows' final (merged) ``out`` and ``lse``."""
    _check(q, k, v, causal)
    name = kernel_name(q.device.type, q.dtype)
    return _fused_or_math(name, _KERNELS[name].backward, math_attention_backward,
                          dout, q, k, v, out, lse, causal, scale)
