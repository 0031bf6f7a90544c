"""The accelerator data path's arithmetic, on the CPU: the fused per-step norm statistics that GPU shards use,
gradients widened inside the accumulation kernel (no fp32 temporary per chunk and micro-batch), and fp16
gradients divided before their reduce-scatter so that the sum over ranks cannot overflow."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zero_cache
from tests.dist_utils import run_distributed
from zero_cache.grad_norm import fused_norm_stats
from zero_cache.grad_reducer import _scale_into, norm_stats


def _shards():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in (5000, 17, 4096, 1)]


def test_fused_norm_stats_equal_the_per_shard_ones():
    shards = _shards()
    ranges = [None, [(0, 5), (9, 17)], None, [(0, 0)]]  # the last shard counts nothing
    want = sum(norm_stats(g, r) for g, r in zip(shards, ranges))
    got = fused_norm_stats(shards, ranges)
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(want.tolist(), rel=1e-6)
    assert got[1].item() == 0.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_fused_norm_stats_flag_non_finite_values_also_outside_the_counted_ranges(bad):
    shards = _shards()
    shards[1][12] = bad  # outside the counted ranges of shard 1
    flagged = fused_norm_stats(shards, [None, [(0, 5)], None, None])
    assert math.isfinite(flagged[0].item()) and flagged[1].item() == 1.0
    shards[2][7] = bad  # inside a counted shard: the sum itself is non-finite
    assert not math.isfinite(fused_norm_stats(shards, [None, [(0, 5)], None, None])[0].item())


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("first", [True, False])
def test_a_bf16_result_is_widened_inside_the_kernel(first):
    value = torch.randn(1000, generator=torch.Generator().manual_seed(2)).bfloat16()
    shard = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    # What accumulating ``value.float()`` computes (the widened copy this path no longer makes).
    want = torch.mul(value.float(), 1 / 3) if first else shard.clone().add_(value.float(), alpha=1 / 3)
    with _Ops() as mode:
        _scale_into(shard, value, 1 / 3, first)
    assert torch.equal(shard, want)  # the fp32 arithmetic of value.float(), bit for bit
    assert not {"_to_copy", "empty", "empty_like", "empty_strided"} & set(mode.ops), mode.ops  # no temporary


def _fp16_step(rank, world_size):
    """One Linear whose weight gradient is 40000 on every rank: fp16 holds it, but not the sum over 2 ranks."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    config = {"train_batch_size": world_size, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "loss_scale": 1.0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = zero_cache.initialize(model=model, config=config)
    x = torch.full((1, 64), 40000.0, dtype=torch.float16)
    engine.backward(engine(x).sum())
    result = engine.step()
    out = {"skipped": result.skipped, "norm": result.grad_norm}
    engine.close()
    return out


@pytest.mark.multiprocess
def test_fp16_gradients_are_divided_before_their_reduce_scatter():
    for r in run_distributed(_fp16_step, 2, timeout=120):
        assert not r["skipped"]  # a sum of 40000 + 40000 in fp16 would be inf, and the step skipped
        assert r["norm"] == pytest.approx(40000.0 * 8.0, rel=1e-3)  # the mean gradient: 40000 in each of 64
