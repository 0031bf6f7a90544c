"""Weight gradients written by the layer into the engine's buffers (zero_cache/weight_grad.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    BETAS,
    CLIP,
    EPS,
    GAS,
    LR,
    STEPS,
    WD,
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    make_model,
    reference_run,
    to_numpy,
    train_engine,
)
from zero_cache.weight_grad import embedding, linear, set_weight_grad_sink, weight_grad_sink

DP = 2


@pytest.mark.parametrize("bias", [True, False])
def test_linear_hands_the_weight_gradient_to_the_sink(bias):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, requires_grad=True)
    weight = nn.Parameter(torch.randn(4, 5))
    b = nn.Parameter(torch.randn(4)) if bias else None
    upstream = torch.randn(2, 3, 4)
    F.linear(x, weight, b).backward(upstream)
    want = (x.grad.clone(), weight.grad.clone(), b.grad.clone() if bias else None)
    x.grad, weight.grad = None, None
    if bias:
        b.grad = None

    received = []

    def sink(write):
        buffer = torch.full_like(weight, float("nan"))  # overwritten: its old values must not matter
        write(buffer, True)
        write(buffer, False)  # and added to
        received.append(buffer)

    set_weight_grad_sink(weight, sink)
    linear(x, weight, b).backward(upstream)
    assert weight.grad is None and len(received) == 1  # autograd made no weight gradient: the sink got it
    torch.testing.assert_close(received[0], 2 * want[1])
    torch.testing.assert_close(x.grad, want[0])
    if bias:
        torch.testing.assert_close(b.grad, want[2])

    x.grad = None
    linear(x, weight, b, fuse=False).backward(upstream)  # a layer that does not own the weight: autograd's way
    torch.testing.assert_close(weight.grad, want[1])
    with torch.no_grad():
        linear(x, weight, b)
    assert len(received) == 1
    set_weight_grad_sink(weight, None)
    assert weight_grad_sink(weight) is None


def test_embedding_hands_the_weight_gradient_to_the_sink():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(10, 6))
    ids = torch.tensor([[1, 3, 3, 9], [0, 3, 1, 1]])  # repeated ids: their rows' gradients are summed
    upstream = torch.randn(2, 4, 6)
    F.embedding(ids, weight).backward(upstream)
    want = weight.grad.clone()
    weight.grad = None

    buffer = torch.full_like(weight, float("nan"))  # stale values: the first write overwrites every row
    writes = []

    def sink(write):
        writes.append(len(writes) == 0)
        write(buffer, writes[-1])

    set_weight_grad_sink(weight, sink)
    out = embedding(ids, weight)
    assert torch.equal(out, F.embedding(ids, weight))
    out.backward(upstream)
    assert weight.grad is None and writes == [True]
    assert torch.equal(buffer, want)  # the same sums in the same order as autograd's embedding backward
    embedding(ids, weight).backward(upstream)  # a second micro-batch adds
    assert writes == [True, False]
    torch.testing.assert_close(buffer, 2 * want)

    embedding(ids, weight, fuse=False).backward(upstream)  # a layer that does not own the weight
    torch.testing.assert_close(weight.grad, want)
    with torch.no_grad():
        embedding(ids, weight)
    assert len(writes) == 2
    set_weight_grad_sink(weight, None)


def _train_fused(rank, world_size, config):
    model = make_model(fused=True)
    fc1 = model.blocks[0].fc1.weight
    autograd_grads = []  # registered before the engine's hook, so it sees param.grad as autograd left it
    fc1.register_post_accumulate_grad_hook(lambda p: autograd_grads.append(p.grad is not None))
    engine = zero_cache.initialize(model=model, config=config)
    engine.register_external_parameter(model.head, model.embed.weight)
    losses = train_engine(engine, batches(), rank, world_size)
    weights = to_numpy(engine.gather_state_dict(rank0_only=False))
    has_sink = weight_grad_sink(fc1) is not None
    engine.close()
    return losses, weights, autograd_grads, has_sink, weight_grad_sink(fc1) is None


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", [
    ds_config(3, DP),  # shard mode; the last chunks keep their buffer across the 2 micro-batches (addmm into it)
    ds_config(3, DP, offload=True, max_param_reduce_events=0),
    ds_config(2, DP),
    ds_config(1, DP),  # full mode: one fp32 buffer summed over micro-batches
], ids=["stage3", "stage3-offload", "stage2", "stage1"])
def test_engine_with_sinks_matches_the_reference(config):
    ref_losses, ref_weights = reference_run(fused=True)
    results = run_distributed(_train_fused, DP, config, timeout=180)
    for _, weights, autograd_grads, has_sink, removed in results:
        # autograd's hook ran once per micro-batch with no gradient tensor: every fc1 gradient went to the sink
        assert has_sink and autograd_grads == [False] * (STEPS * GAS)
        assert removed  # close() hands the parameters back to autograd
        assert_close_weights(weights, ref_weights[-1])
    assert_close_losses([sum(r[0][s] for r in results) / DP for s in range(STEPS)], ref_losses)


class _SharedWeight(nn.Module):
    """One weight under two names, both fused; another used by a fused layer and by plain autograd."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.c = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = linear(x, self.a.weight, self.a.bias) + linear(torch.tanh(x), self.b.weight, self.b.bias)
        return (linear(h, self.c.weight) + F.linear(h.square(), self.c.weight)).square().mean()


def _shared(rank, world_size):
    torch.manual_seed(0)
    model = _SharedWeight()
    reference = copy.deepcopy(model)
    config = ds_config(3, world_size, stage3_param_persistence_threshold=0)
    engine = zero_cache.initialize(model=model, config=config)
    for p in model.parameters():  # the root module's forward reads them
        engine.register_external_parameter(model, p)
    data = [torch.randn(4, 8) for _ in range(GAS)]
    for x in data:
        engine.backward(engine(x))
    result = engine.step()
    got = to_numpy(engine.gather_state_dict())

    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    (sum(reference(x) for x in data) / GAS).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP).item()
    opt.step()
    return result.grad_norm, norm, got, {k: v.detach().clone() for k, v in reference.state_dict().items()}


@pytest.mark.multiprocess
def test_shared_weights_get_the_sum_of_sink_and_autograd_gradients():
    got_norm, ref_norm, got, ref = run_distributed(_shared, 1, timeout=60)[0]
    assert abs(got_norm - ref_norm) <= 1e-5 * ref_norm
    assert_close_weights(got, ref)


def _train_bf16_stage1(rank, world_size, fused):
    config = ds_config(1, world_size)
    config["bf16"] = {"enabled": True}
    model = make_model(fused=fused)
    engine = zero_cache.initialize(model=model, config=config)
    engine.register_external_parameter(model.head, model.embed.weight)
    return train_engine(engine, batches(4), rank, world_size)


@pytest.mark.multiprocess
def test_bf16_model_with_fp32_full_buffers():
    """Stage 1 sums a 16-bit model's gradients in fp32 buffers: the sink adds the product in that dtype."""
    fused = run_distributed(_train_bf16_stage1, DP, True, timeout=180)
    plain = run_distributed(_train_bf16_stage1, DP, False, timeout=180)
    for got, want in zip(fused, plain):
        assert_close_losses(got, want, rel=1e-3)
