"""Context-parallel attention on a GPU (skipped without one; benchmarks/gpu_check.sh runs them on a GPU machine):
the fused CUDA block kernels (flash in bf16, memory-efficient in fp32) against the plain implementation on CUDA,
including backward given a merged (out, lse), which ring and all-gather attention rely on; all-gather attention
over an NCCL group of one GPU; and ring / all-to-all / all-gather attention over NCCL on 2 GPUs against
one-process attention (skipped in the test body with fewer GPUs)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import context_parallel_attention, gather_from_context_parallel
from megatron.core.context_parallel import split_for_context_parallel as split
from megatron.core.context_parallel.attention_kernels import (
    _KERNELS,
    kernel_name,
    math_attention_backward,
    math_attention_forward,
)
from tests.cuda.common import CUDA, gpu_only, strict_fp32
from tests.dist_utils import run_distributed

pytestmark = gpu_only()
RANK_TIMEOUT = 120
# The fused kernel each dtype should get on a recent GPU (sm80+).
EXPECTED_KERNEL = {torch.bfloat16: "flash_cuda", torch.float32: "efficient_cuda"}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _tol(dtype: torch.dtype) -> float:
    """Relative (norm) error allowed: bf16 kernels round their outputs and products (about 4e-3 on the CPU's
    flash kernel at these sizes); fp32 ones only accumulate in another order."""
    return 2e-2 if dtype == torch.bfloat16 else 1e-4


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(CUDA, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_kernels_equal_math_on_the_gpu(dtype):
    """The dtype's fused kernel, called directly (so that an error shows) then through the probe's choice:
    forward (out, lse) and backward against the plain fp32 implementation, causal and not (sq != sk); then
    two key blocks merged by LSE and each block's backward given the merged (out, lse), against one block."""
    name = EXPECTED_KERNEL[dtype]
    kernel = _KERNELS[name]
    gen = torch.Generator().manual_seed(0)
    b, h, d = 2, 4, 64
    for sq, sk, causal in ((256, 256, True), (128, 320, False)):
        q, dout = _rand(gen, b, h, sq, d, dtype=dtype), _rand(gen, b, h, sq, d, dtype=dtype)
        k, v = _rand(gen, b, h, sk, d, dtype=dtype), _rand(gen, b, h, sk, d, dtype=dtype)
        out, lse = kernel.forward(q, k, v, causal, None)
        out_m, lse_m = math_attention_forward(q, k, v, causal, None)
        assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
        assert _rel_err(out, out_m) < _tol(dtype) and _rel_err(lse, lse_m) < 1e-4
        grads = kernel.backward(dout, q, k, v, out_m, lse_m, causal, None)
        for got, want in zip(grads, math_attention_backward(dout, q, k, v, out_m, lse_m, causal, None)):
            assert got.dtype == dtype and _rel_err(got, want) < _tol(dtype)
    assert kernel_name("cuda", dtype) == name

    # A causal diagonal block after a full one, merged by LSE, against the two as one block.
    q, dout = _rand(gen, b, h, 128, d, dtype=dtype), _rand(gen, b, h, 128, d, dtype=dtype)
    k, v = _rand(gen, b, h, 256, d, dtype=dtype), _rand(gen, b, h, 256, d, dtype=dtype)
    (out_a, lse_a), (out_b, lse_b) = (kernel.forward(q, k[:, :, :128], v[:, :, :128], False, None),
                                      kernel.forward(q, k[:, :, 128:], v[:, :, 128:], True, None))
    lse = torch.logaddexp(lse_a, lse_b)
    out = (out_a.float() * (lse_a - lse).exp().unsqueeze(-1) + out_b.float() * (lse_b - lse).exp().unsqueeze(-1))
    out = out.to(dtype)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    mask = torch.cat([torch.ones(128, 128, device=CUDA), torch.ones(128, 128, device=CUDA).tril()], dim=1).bool()
    scores = (qd @ kd.transpose(-1, -2) * d ** -0.5).masked_fill(~mask, float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ vd
    ref.backward(dout.double())
    assert _rel_err(out, ref) < _tol(dtype)
    dq_a, dk_a, dv_a = kernel.backward(dout, q, k[:, :, :128], v[:, :, :128], out, lse, False, None)
    dq_b, dk_b, dv_b = kernel.backward(dout, q, k[:, :, 128:], v[:, :, 128:], out, lse, True, None)
    assert _rel_err(dq_a.float() + dq_b.float(), qd.grad) < _tol(dtype)
    assert _rel_err(torch.cat([dk_a, dk_b], dim=2), kd.grad) < _tol(dtype)
    assert _rel_err(torch.cat([dv_a, dv_b], dim=2), vd.grad) < _tol(dtype)


CASES = [("p2p", 8, 2, torch.bfloat16), ("p2p", 8, 8, torch.float32), ("a2a", 8, 2, torch.bfloat16),
         ("a2a", 8, 8, torch.float32), ("allgather", 8, 2, torch.bfloat16), ("allgather", 8, 8, torch.float32)]
SEQ, HEAD_DIM = 512, 64


def _inputs(hq: int, hkv: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, hq, SEQ, HEAD_DIM), (2, hkv, SEQ, HEAD_DIM), (2, hkv, SEQ, HEAD_DIM), (2, hq, SEQ, HEAD_DIM)]
    return [torch.randn(*s, generator=gen).to(dtype) for s in shapes]


def _reference(hq: int, hkv: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Causal attention's out, dq, dk, dv of one case in float64 on the host."""
    q, k, v, dout = (t.double().requires_grad_(True) for t in _inputs(hq, hkv, dtype, seed))
    kr, vr = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    scores = (q @ kr.transpose(-1, -2) * HEAD_DIM ** -0.5).masked_fill(
        torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ vr
    ref.backward(dout)
    return [ref.detach(), q.grad, k.grad, v.grad]


def _nccl_cases(rank: int, world: int, cases: list[tuple]) -> dict:
    """Every case on the NCCL ranks: this rank's out, dq, dk, dv on the host."""
    strict_fp32()
    torch.cuda.set_device(rank)
    results = {}
    for seed, (comm_type, hq, hkv, dtype) in enumerate(cases):
        q, k, v, dout = (split(t, 2, world, rank).cuda() for t in _inputs(hq, hkv, dtype, seed))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        out = context_parallel_attention(q, k, v, comm_type=comm_type, group=dist.group.WORLD)
        out.backward(dout)
        results[seed] = [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]
    return results


@pytest.mark.multiprocess
def test_ring_all_to_all_and_all_gather_over_nccl_equal_full_attention():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL takes one rank per GPU)")
    outs = run_distributed(_nccl_cases, 2, CASES, backend="nccl", timeout=RANK_TIMEOUT)
    for seed, (comm_type, hq, hkv, dtype) in enumerate(CASES):
        for i, want in enumerate(_reference(hq, hkv, dtype, seed)):
            got = gather_from_context_parallel([outs[r][seed][i] for r in range(2)], dim=2)
            assert got.dtype == dtype and _rel_err(got, want) < _tol(dtype), (comm_type, hq, hkv, dtype, i)


@pytest.mark.multiprocess
def test_all_gather_attention_on_one_gpu_equals_full_attention():
    """CP 1 on one GPU: the all-gather and reduce-scatter over an NCCL group of one, the own block through the fused
    kernels (flash in bf16, memory-efficient in fp32) with grouped heads repeated and summed back."""
    cases = [c for c in CASES if c[0] == "allgather"]
    out = run_distributed(_nccl_cases, 1, cases, backend="nccl", timeout=RANK_TIMEOUT)[0]
    for seed, (_, hq, hkv, dtype) in enumerate(cases):
        for i, want in enumerate(_reference(hq, hkv, dtype, seed)):
            assert out[seed][i].dtype == dtype and _rel_err(out[seed][i], want) < _tol(dtype), (hq, hkv, dtype, i)
