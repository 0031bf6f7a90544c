"""Mixture of experts on a GPU (skipped without one; benchmarks/gpu_check.sh runs them on a GPU machine): the
grouped matmul torch offers there (bf16) and the MoE layer on CUDA against the same layer on the CPU. An MoE GPT
through the trainer on a GPU: test_cuda_paths.py's trainer test."""
from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.moe.config import MoEConfig
from megatron.core.moe.experts import _grouped_mm_works, grouped_mm
from megatron.core.transformer_config import TransformerConfig
from megatron.model.transformer import build_mlp
from tests.cuda.common import CUDA, gpu_only, strict_fp32
from tests.dist_utils import run_distributed

pytestmark = gpu_only()
RANK_TIMEOUT = 120


def test_grouped_matmul_runs_in_bf16_on_the_gpu():
    """On a GPU with torch's grouped matmul (sm90) the experts take it, and it equals a loop over the experts."""
    assert _grouped_mm_works("cuda", torch.bfloat16), "torch._grouped_mm is not usable here: the experts loop"
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [40, 0, 88, 128]
    x = torch.randn(sum(counts), 256, device=CUDA, generator=gen).bfloat16()
    w = torch.randn(4, 256, 512, device=CUDA, generator=gen).bfloat16()
    offs = torch.tensor(counts, device=CUDA).cumsum(0).to(torch.int32)
    grouped = grouped_mm(x, w, counts, offs).float()
    loop = grouped_mm(x, w, counts, None).float()
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-1)


def _layer_on_cuda_and_cpu(rank: int, world: int) -> bool:
    strict_fp32()
    ps.initialize_model_parallel(1, 1)
    moe = MoEConfig(num_experts=6, router_topk=2, ffn_hidden_size=48, shared_expert_intermediate_size=32)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=64,
                            swiglu=True, add_bias_linear=False, moe=moe)
    cpu = build_mlp(cfg, "decoder.layers.0.mlp.", 0, None, None)
    gpu = build_mlp(cfg, "decoder.layers.0.mlp.", 0, None, None).to(CUDA)
    for layer in (cpu, gpu):
        layer.aux_loss_scale = type("Scale", (), {"value": 1.0})()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    outs = []
    for layer, device in ((cpu, "cpu"), (gpu, CUDA)):
        xi = x.to(device).requires_grad_(True)
        out = layer(xi)
        out.square().sum().backward()
        outs.append((out.detach().cpu(), xi.grad.cpu(), {n: p.grad.cpu() for n, p in layer.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    for name, grad in outs[0][2].items():
        torch.testing.assert_close(outs[1][2][name], grad, rtol=1e-4, atol=1e-5)
    return True


@pytest.mark.multiprocess
def test_moe_layer_on_cuda_equals_the_cpu_layer():
    assert run_distributed(_layer_on_cuda_and_cpu, 1, backend="nccl", timeout=RANK_TIMEOUT)[0]
