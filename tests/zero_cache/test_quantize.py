"""Block-wise int8 quantization (qwZ / qgZ): round-trip error bounds, packing, non-finite values; the config
rules and layouts hierarchical ZeRO-3 refuses."""
from __future__ import annotations

import pytest
import torch

from zero_cache.config import ZeroConfigError, parse_config
from zero_cache.quantize import dequantize_into, packed_nbytes, quantize
from zero_cache.topology import host_size


@pytest.mark.parametrize("numel,block,dtype,bits", [(1000, 64, torch.float32, 8), (4096, 256, torch.float32, 8),
                                                    (333, 16, torch.bfloat16, 8), (1000, 64, torch.float32, 4),
                                                    (333, 16, torch.bfloat16, 4)])
def test_round_trip_error_is_at_most_half_a_step_per_block(numel, block, dtype, bits):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)).to(dtype)
    packed = quantize(x, block, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(numel, block, bits)
    assert packed.numel() <= -(-numel // block) * (block * bits // 8 + 4)
    out = torch.empty(numel, dtype=torch.float32)
    dequantize_into(out, packed, block, bits=bits)
    ref = x.float()
    pad = -numel % block
    step = torch.nn.functional.pad(ref.abs(), (0, pad)).view(-1, block).amax(dim=1) / (2 ** (bits - 1) - 1)
    bound = (step / 2).repeat_interleave(block)[:numel]
    assert torch.all((out - ref).abs() <= bound * (1 + 1e-6) + 1e-30)
    assert not torch.equal(out, ref)  # it is lossy: the test would notice a pass-through


def test_zero_blocks_and_accumulation():
    x = torch.zeros(128)
    x[64:] = torch.linspace(-1, 1, 64)
    packed = quantize(x, 64)
    out = torch.full((128,), 5.0)
    dequantize_into(out, packed, 64)
    assert torch.equal(out[:64], torch.zeros(64))
    before = out.clone()
    dequantize_into(out, packed, 64, accumulate=True)
    torch.testing.assert_close(out, 2 * before)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_non_finite_value_spoils_only_its_block(bits):
    x = torch.ones(192)
    x[70] = float("inf")
    out = torch.empty(192)
    dequantize_into(out, quantize(x, 64, bits), 64, bits=bits)
    assert not out[64:128].isfinite().any()  # the overflow stays visible after a quantized reduction
    assert torch.equal(out[:64], torch.ones(64)) and torch.equal(out[128:], torch.ones(64))


def _config(**zero) -> dict:
    return {"train_batch_size": 8, "zero_optimization": {"stage": 3, **zero}}


@pytest.mark.parametrize("zero,message", [
    ({"stage": 2, "mics_shard_size": 2}, "'zero_optimization.mics_shard_size' needs stage 3"),
    ({"stage": 1, "zero_quantized_gradients": True}, "'zero_optimization.zero_quantized_gradients' needs stage 3"),
    ({"mics_shard_size": 2, "zero_hpz_partition_size": 2}, "exclude each other"),
    ({"quantization_block_size": 8}, "quantization_block_size"),
    ({"quantized_gradients_bits": 2}, "quantized_gradients_bits"),
])
def test_refused_configs_name_the_key(zero, message):
    with pytest.raises(ZeroConfigError, match=message):
        parse_config(_config(**zero), dp_world_size=4)


def test_deepspeed_zeropp_and_mics_keys_are_accepted():
    cfg = parse_config(_config(zero_hpz_partition_size=8, zero_quantized_weights=True, zero_quantized_gradients=True,
                               zero_quantized_nontrainable_weights=False), dp_world_size=8)
    assert cfg.zero_optimization.zero_hpz_partition_size == 8
    assert parse_config(_config(mics_shard_size=4, mics_hierarchical_params_gather=True),
                        dp_world_size=8).zero_optimization.mics_shard_size == 4


def test_hosts_are_read_from_contiguous_rank_blocks():
    assert host_size([0, 1, 2, 3], 2) == 2
    assert host_size([0, 2, 4, 6], 4) == 2  # tensor parallel 2 inside 4-rank hosts: two members per host
    with pytest.raises(ZeroConfigError, match="not spread evenly over hosts"):
        host_size([0, 1, 2], 2)
