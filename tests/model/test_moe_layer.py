"""The MoE layer against a naive reference (each token through its top-k experts, one at a time), the
router's options, the balancing losses, and expert parallelism inside one layer."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.moe.config import MoEConfig, parse_layer_freq
from megatron.core.transformer_config import TransformerConfig
from megatron.model.transformer import build_mlp
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess

H, F_MOE, E = 16, 24, 6


def _config(**moe_kw):
    swiglu = moe_kw.pop("swiglu", True)
    moe = MoEConfig(num_experts=E, router_topk=moe_kw.pop("topk", 2), ffn_hidden_size=F_MOE, **moe_kw)
    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=8,
                             padded_vocab_size=64, swiglu=swiglu, add_bias_linear=False, moe=moe)


def _reference(layer, x, cfg):
    """Every token, every choice, in a loop: softmax/sigmoid scores, top-k, capacity, expert MLP, sum."""
    moe = cfg.moe
    tokens = x.reshape(-1, H)
    logits = tokens.float() @ layer.router.weight.float().t()
    bias = layer.router.expert_bias if moe.enable_expert_bias else torch.zeros(E)
    fc1 = layer.experts.linear_fc1.weight
    fc2 = layer.experts.linear_fc2.weight
    gate = layer.experts.linear_fc1_gate.weight if cfg.swiglu else None
    choices = []
    for t in range(tokens.shape[0]):
        if moe.score_function == "softmax":
            scores = torch.softmax(logits[t], -1)
        else:
            scores = torch.sigmoid(logits[t])
        idx = sorted(range(E), key=lambda e: -(scores[e] + bias[e]).item())[:moe.router_topk]
        w = scores[idx]
        if not moe.pre_softmax:
            w = w / w.sum()
        choices.append([(e, w[j]) for j, e in enumerate(idx)])
    kept = {(t, e) for t in range(len(choices)) for e, _ in choices[t]}
    capacity = moe.capacity(tokens.shape[0])
    if capacity is not None:  # per expert: the most probable choices
        kept = set()
        for e in range(E):
            mine = sorted(((w.item(), t) for t in range(len(choices)) for ee, w in choices[t] if ee == e),
                          key=lambda p: (-p[0], p[1]))
            kept |= {(t, e) for _, t in mine[:capacity]}
    out = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(H)
        for e, w in choices[t]:
            if (t, e) not in kept:
                continue
            h = tokens[t] @ fc1[e].t()
            h = F.silu(tokens[t] @ gate[e].t()) * h if gate is not None else F.gelu(h)
            acc = acc + w * (h @ fc2[e].t())
        out.append(acc)
    out = torch.stack(out)
    if hasattr(layer, "shared_experts"):
        out = out + layer.shared_experts(tokens)
    return out.view_as(x)


def _check(rank, world, moe_kw):
    ps.initialize_model_parallel(1, 1)
    cfg = _config(**moe_kw)
    torch.manual_seed(0)
    layer = build_mlp(cfg, "decoder.layers.0.mlp.", 0, None, None)
    if cfg.moe.enable_expert_bias:
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
    x = torch.randn(2, 8, H, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    layer.aux_loss_scale = type("S", (), {"value": 1.0})()
    out = layer(x)
    ref = _reference(layer, x_ref, cfg)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(layer.parameters()), g)
    ref_grads = torch.autograd.grad(ref, [x_ref] + list(layer.parameters()), g)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    return True


@pytest.mark.parametrize("moe_kw", [
    {},
    {"swiglu": False},
    {"pre_softmax": True, "topk": 3},
    {"score_function": "sigmoid", "enable_expert_bias": True},
    {"capacity_factor": 0.5},
    {"capacity_factor": 0.75, "topk": 1},
    {"shared_expert_intermediate_size": 20, "shared_expert_gate": True},
    {"grouped_gemm": False},
], ids=["softmax-swiglu", "gelu", "pre-softmax-top3", "sigmoid-bias", "capacity", "capacity-top1", "shared-gated",
        "loop"])
def test_moe_layer_equals_naive_reference(moe_kw):
    assert run_distributed(_check, 1, moe_kw)[0]


def test_capacity_drops_tokens():
    cfg = _config(capacity_factor=0.5)
    assert cfg.moe.capacity(16) == 3  # ceil(16 tokens x 2 choices x 0.5 / 6 experts)


def test_layer_freq_patterns():
    assert parse_layer_freq("2") == 2
    assert parse_layer_freq("([1]*3+[0])*2") == (1, 1, 1, 0, 1, 1, 1, 0)
    assert parse_layer_freq("[1,0]") == (1, 0)
    with pytest.raises(ValueError, match="moe-layer-freq"):
        parse_layer_freq("__import__('os')")
    moe = MoEConfig(num_experts=4, layer_freq=2)
    assert [moe.is_moe_layer(i, 4) for i in range(4)] == [True, False, True, False]
