"""Context-parallel attention (megatron/core/context_parallel): the load-balanced layout, the block kernels
against the plain implementation, and ring / all-to-all attention on gloo ranks against full-sequence causal
attention on one process (float64 reference, fp32 runs)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import (
    all_gather_attention,
    chunk_ids,
    context_parallel_attention,
    gather_from_context_parallel,
    ring_attention,
    split_for_context_parallel,
    to_load_balanced_order,
    to_natural_order,
)
from megatron.core.context_parallel import attention_kernels as kernels
from megatron.core.context_parallel.attention_kernels import (
    attention_backward,
    attention_forward,
    kernel_name,
    math_attention_backward,
    math_attention_forward,
)
from tests.dist_utils import run_distributed

BATCH, HEAD_DIM = 2, 8
RANK_TIMEOUT = 120


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _reference(q, k, v, dout, causal: bool, scale: float | None = None):
    """Plain softmax attention under autograd in float64: (out, lse, dq, dk, dv); k/v heads repeated to q's."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q @ kr.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, dim=-1) @ vr
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), q.grad, k.grad, v.grad


# --- load-balanced layout ---------------------------------------------------------------------------------------

def test_chunk_ids_pair_each_chunk_with_its_mirror():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError, match="outside 0..1"):
        chunk_ids(2, 2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_and_gather_round_trip(cp):
    t = torch.arange(3 * 16).view(3, 16)
    parts = [split_for_context_parallel(t, 1, cp, r) for r in range(cp)]
    assert all(p.shape == (3, 16 // cp) for p in parts)
    torch.testing.assert_close(gather_from_context_parallel(parts, dim=1), t)
    torch.testing.assert_close(to_load_balanced_order(t, 1, cp), torch.cat(parts, dim=1))
    torch.testing.assert_close(to_natural_order(torch.cat(parts, dim=1), 1, cp), t)


def test_split_holds_chunk_r_then_its_mirror():
    t = torch.arange(8)
    assert split_for_context_parallel(t, 0, 2, 0).tolist() == [0, 1, 6, 7]
    assert split_for_context_parallel(t, 0, 2, 1).tolist() == [2, 3, 4, 5]
    assert split_for_context_parallel(t, 0, 1, 0) is t


def test_split_rejects_a_length_not_divisible_by_twice_cp():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 x --context-parallel-size 4"):
        split_for_context_parallel(torch.zeros(2, 10), 1, 4, 0)


# --- block kernels ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,sq,sk", [(True, 12, 12), (False, 8, 20)])
def test_math_kernel_equals_autograd_softmax(causal, sq, sk):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _rand(gen, 2, 3, sq, 8, dtype=torch.float64), *(_rand(gen, 2, 3, sk, 8, dtype=torch.float64)
                                                                for _ in range(2))
    dout = _rand(gen, 2, 3, sq, 8, dtype=torch.float64)
    out_ref, lse_ref, *grads_ref = _reference(q, k, v, dout, causal, scale=0.4)
    out, lse = math_attention_forward(q, k, v, causal, 0.4)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref)
    for got, want in zip(math_attention_backward(dout, q, k, v, out, lse, causal, 0.4), grads_ref):
        torch.testing.assert_close(got, want)


def test_the_cpu_kernel_is_the_fused_one_and_unknown_devices_use_math():
    assert kernel_name("cpu", torch.float32) == "flash_cpu"
    assert kernel_name("cpu", torch.float64) == "flash_cpu"
    assert kernel_name("no_such_device", torch.float32) == "math"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("causal,sq,sk", [(True, 16, 16), (False, 8, 24)])
def test_kernel_forward_and_backward_equal_math(dtype, causal, sq, sk):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _rand(gen, 2, 2, sq, 8, dtype=dtype), _rand(gen, 2, 2, sk, 8, dtype=dtype), _rand(gen, 2, 2, sk, 8,
                                                                                                  dtype=dtype)
    dout = _rand(gen, 2, 2, sq, 8, dtype=dtype)
    out, lse = attention_forward(q, k, v, causal)
    out_m, lse_m = math_attention_forward(q, k, v, causal, None)
    assert lse.dtype == torch.promote_types(dtype, torch.float32) and lse.shape == (2, 2, sq)
    torch.testing.assert_close(out, out_m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_m, rtol=1e-5, atol=1e-5)
    for got, want in zip(attention_backward(dout, q, k, v, out, lse, causal),
                         math_attention_backward(dout, q, k, v, out_m, lse_m, causal, None)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_backward_with_the_merged_out_and_lse_sums_to_the_full_gradient():
    """The identity ring attention rests on: per key block, backward given the whole row's out and lse; the
    blocks' dq add up and their dk/dv are the full ones (causal diagonal block + a full block before it)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (_rand(gen, 2, 2, 8, 8) for _ in range(4))
    prev_k, prev_v = _rand(gen, 2, 2, 8, 8), _rand(gen, 2, 2, 8, 8)
    # Row i attends to all of the previous block and causally to the diagonal one.
    kk, vv = torch.cat([prev_k, k], dim=2), torch.cat([prev_v, v], dim=2)
    mask = torch.cat([torch.ones(8, 8), torch.ones(8, 8).tril()], dim=1).bool()
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, kk, vv))
    s = (qd @ kd.transpose(-1, -2) * 8 ** -0.5).masked_fill(~mask, float("-inf"))
    out_ref = torch.softmax(s, -1) @ vd
    out_ref.backward(dout.double())
    out_a, lse_a = attention_forward(q, prev_k, prev_v, False)
    out_b, lse_b = attention_forward(q, k, v, True)
    lse = torch.logaddexp(lse_a, lse_b)
    out = (out_a * (lse_a - lse).exp().unsqueeze(-1) + out_b * (lse_b - lse).exp().unsqueeze(-1))
    torch.testing.assert_close(out.double(), out_ref.detach(), rtol=1e-5, atol=1e-5)
    dq_a, dk_a, dv_a = attention_backward(dout, q, prev_k, prev_v, out, lse, False)
    dq_b, dk_b, dv_b = attention_backward(dout, q, k, v, out, lse, True)
    torch.testing.assert_close((dq_a + dq_b).double(), qd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([dk_a, dk_b], 2).double(), kd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([dv_a, dv_b], 2).double(), vd.grad, rtol=1e-5, atol=1e-5)


def test_a_fused_kernel_that_refuses_a_block_falls_back_to_math(monkeypatch):
    def refuse(*args):
        raise RuntimeError("no kernel for this head dim")

    name = kernel_name("cpu", torch.float32)
    monkeypatch.setitem(kernels._KERNELS, name, kernels._Kernel(refuse, refuse))
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (_rand(gen, 1, 2, 4, 8) for _ in range(4))
    with pytest.warns(UserWarning, match="no kernel for this head dim"):
        out, lse = attention_forward(q, k, v, True)
    torch.testing.assert_close(out, math_attention_forward(q, k, v, True, None)[0])
    with pytest.warns(UserWarning):
        grads = attention_backward(dout, q, k, v, out, lse, True)
    for got, want in zip(grads, math_attention_backward(dout, q, k, v, out, lse, True, None)):
        torch.testing.assert_close(got, want)


def test_kernel_errors():
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="as many queries as keys"):
        attention_forward(x, torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), True)
    with pytest.raises(ValueError, match="repeat grouped key/value heads"):
        attention_forward(x, torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), False)


# --- errors raised before any communication ---------------------------------------------------------------------

def test_ring_and_all_gather_attention_errors():
    q, kv = torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match="dropout 0.1 is not supported by ring attention"):
        ring_attention(q, kv, kv, None, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout 0.1 is not supported by all-gather attention"):
        all_gather_attention(q, kv, kv, None, dropout_p=0.1)
    with pytest.raises(ValueError, match="all-gather attention takes q"):
        all_gather_attention(q, kv[0], kv[0], None)
    with pytest.raises(ValueError, match="not a multiple of 3 key/value heads.*--num-query-groups"):
        ring_attention(q, torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8), None)
    with pytest.raises(ValueError, match="local sequence length 7 is odd"):
        ring_attention(torch.zeros(1, 4, 7, 8), torch.zeros(1, 2, 7, 8), torch.zeros(1, 2, 7, 8), None)
    with pytest.raises(ValueError, match="--cp-comm-type 'ring' is not one of p2p, a2a, allgather"):
        context_parallel_attention(q, kv, kv, comm_type="ring", group=None)


# --- ring and all-to-all attention on gloo ranks ------------------------------------------------------------------

def _inputs(hq: int, hkv: int, seq: int, seed: int, dtype: torch.dtype = torch.float32):
    """The full-sequence q, k, v and dout of one case (every rank and the reference draw the same)."""
    gen = torch.Generator().manual_seed(seed)
    return (_rand(gen, BATCH, hq, seq, HEAD_DIM, dtype=dtype), _rand(gen, BATCH, hkv, seq, HEAD_DIM, dtype=dtype),
            _rand(gen, BATCH, hkv, seq, HEAD_DIM, dtype=dtype), _rand(gen, BATCH, hq, seq, HEAD_DIM, dtype=dtype))


def _cp_cases(rank: int, world: int, runs: list[tuple[list[list[int]] | None, list[tuple]]]) -> list[dict]:
    """For each run (CP groups: None for the world, else a partition of the ranks; cases): every case
    (comm_type, hq, hkv, seq, seed[, dtype]) on this rank's CP group, giving this rank's out, dq, dk, dv; plus the
    message of the all-to-all head check and this rank's CP rank."""
    results = []
    for subgroups, cases in runs:
        group = dist.group.WORLD
        for ranks in subgroups or []:
            made = dist.new_group(ranks)  # every rank creates every group, in the same order
            group = made if rank in ranks else group
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        res = {"cp_rank": cp_rank}
        for case in cases:
            q, k, v, dout = (split_for_context_parallel(t, 2, cp, cp_rank) for t in _inputs(*case[1:]))
            # Laid out [b, s, h, d] in memory, as the trainer's projections leave them.
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
            out = context_parallel_attention(q, k, v, comm_type=case[0], group=group)
            out.backward(dout)
            res[case] = (out.detach(), q.grad, k.grad, v.grad)
        if cp > 1:
            x = torch.zeros(1, 3 * cp - 1, 4, 8)
            with pytest.raises(ValueError) as err:
                context_parallel_attention(x, x, x, comm_type="a2a", group=group)
            res["head_error"] = str(err.value)
        results.append(res)
    return results


def _check_against_reference(outs: list[dict], members: list[int], cases: list[tuple]) -> None:
    """The CP ranks ``members`` (global ranks, in CP-rank order) together equal the one-process reference."""
    assert [outs[r]["cp_rank"] for r in members] == list(range(len(members)))
    for case in cases:
        q, k, v, dout = _inputs(*case[1:])
        out, _, *grads = _reference(q, k, v, dout, causal=True)
        tol = 1e-5 if q.dtype == torch.float32 else 3e-2  # bf16: the inputs' own rounding, outputs rounded
        for name, want, i in zip(("out", "dq", "dk", "dv"), (out, *grads), range(4)):
            got = gather_from_context_parallel([outs[r][case][i] for r in members], dim=2)
            assert got.dtype == q.dtype
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=f"{case} {name}")


CP2_CASES = [("p2p", 4, 4, 16, 0), ("p2p", 4, 2, 24, 1), ("p2p", 4, 1, 32, 2),
             ("a2a", 4, 4, 16, 3), ("a2a", 4, 2, 24, 4), ("a2a", 4, 1, 32, 5),
             ("allgather", 4, 4, 16, 13), ("allgather", 3, 1, 24, 14),
             ("p2p", 4, 2, 16, 11, torch.bfloat16), ("a2a", 4, 2, 16, 12, torch.bfloat16),
             ("allgather", 4, 2, 16, 15, torch.bfloat16)]
# CP 4: a2a repeats the 2 key/value heads (they do not split over 4); CP 2 over subgroups {1, 3} and {0, 2},
# whose group ranks are not the global ones; CP 1 (no communication).
CP4_CASES = [("p2p", 4, 2, 32, 6), ("p2p", 2, 2, 16, 7), ("a2a", 4, 2, 32, 8), ("allgather", 4, 2, 32, 16)]
SUBGROUP_CASES = [("p2p", 4, 2, 24, 9), ("a2a", 4, 2, 24, 10), ("allgather", 4, 2, 24, 17)]


@pytest.mark.multiprocess
def test_cp2_ring_all_to_all_and_all_gather_equal_full_attention():
    outs = [r[0] for r in run_distributed(_cp_cases, 2, [(None, CP2_CASES)], timeout=RANK_TIMEOUT)]
    _check_against_reference(outs, [0, 1], CP2_CASES)
    message = outs[0]["head_error"]
    assert "5 query heads per tensor-parallel rank (--num-attention-heads / TP)" in message
    assert "--context-parallel-size 2" in message and "--num-query-groups" in message


@pytest.mark.multiprocess
def test_cp4_cp2_subgroups_and_cp1_equal_full_attention():
    runs = [(None, CP4_CASES), ([[1, 3], [0, 2]], SUBGROUP_CASES), ([[0], [1], [2], [3]], SUBGROUP_CASES)]
    outs = run_distributed(_cp_cases, 4, runs, timeout=RANK_TIMEOUT)
    _check_against_reference([r[0] for r in outs], [0, 1, 2, 3], CP4_CASES)
    assert "--context-parallel-size 4" in outs[0][0]["head_error"]
    sub = [r[1] for r in outs]
    _check_against_reference(sub, [1, 3], SUBGROUP_CASES)
    _check_against_reference(sub, [0, 2], SUBGROUP_CASES)
    for rank in range(4):
        _check_against_reference([r[2] for r in outs], [rank], SUBGROUP_CASES)
