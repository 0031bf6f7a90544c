"""The gradient norm's sum of squares, against float64, at the element counts of real gradient shards."""
from __future__ import annotations

import math

import pytest
import torch

from zero_cache.grad_norm import sum_of_squares
from zero_cache.grad_reducer import norm_stats

N = 20_000_003  # a shard of a 1B model's gradient; not a multiple of the block


@pytest.fixture(scope="module")
def grad():
    return torch.randn(N, generator=torch.Generator().manual_seed(0)) * 1e-3


def exact(t: torch.Tensor) -> float:
    return t.double().square().sum().item()


def test_sum_of_squares_matches_float64_at_shard_size(grad):
    # torch's fp32 norm of this tensor is off by about 1e-3 relative on CPU
    for t in (grad, grad[5:-7], grad[:4096 * 3]):
        got = sum_of_squares(t)
        assert got.dtype == torch.float64 and got.shape == ()
        assert got.item() == pytest.approx(exact(t), rel=1e-7)


def test_sum_of_squares_of_low_precision_float64_and_tiny_tensors():
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    assert sum_of_squares(t.bfloat16()).item() == pytest.approx(exact(t.bfloat16()), rel=1e-6)
    assert sum_of_squares(t.double()).item() == pytest.approx(exact(t), rel=1e-12)
    assert sum_of_squares(t[:3].reshape(3, 1)).item() == pytest.approx(exact(t[:3]), rel=1e-6)
    assert sum_of_squares(torch.empty(0)).item() == 0.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_element_makes_the_sum_non_finite(grad, bad):
    t = grad[:3 * 4096 + 5].clone()
    t[4096 + 17] = bad
    assert not math.isfinite(sum_of_squares(t).item())
    t = grad[:3 * 4096 + 5].clone()
    t[-1] = bad  # in the tail after the last whole block
    assert not math.isfinite(sum_of_squares(t).item())


def test_norm_stats_over_ranges_matches_float64(grad):
    ranges = [(0, 7_000_001), (9_000_000, N)]
    stats = norm_stats(grad, ranges)
    assert stats[0].item() == pytest.approx(sum(exact(grad[a:b]) for a, b in ranges), rel=1e-7)
    assert stats[1].item() == 0.0
    assert norm_stats(grad, None)[0].item() == pytest.approx(exact(grad), rel=1e-7)
