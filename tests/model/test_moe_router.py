"""The router's pieces on their own: balancing losses, capacity, the expert-bias update, the load statistics."""
import pytest
import torch

from megatron.core.moe.aux_loss import MoEStats
from megatron.core.moe.config import MoEConfig
from megatron.core.moe.router import TopKRouter, switch_load_balancing_loss, update_expert_bias


def _router(**kw) -> TopKRouter:
    moe = MoEConfig(num_experts=4, **kw)
    return TopKRouter(moe, 8, lambda t: t.normal_(0, 1, generator=torch.Generator().manual_seed(0)))


def test_switch_loss_is_one_for_an_even_load_and_larger_otherwise():
    even = switch_load_balancing_loss(torch.full((8, 4), 0.25), torch.tensor([4, 4, 4, 4]), topk=2)
    skewed = switch_load_balancing_loss(torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8), torch.tensor([8, 8, 0, 0]), topk=2)
    assert even.item() == pytest.approx(1.0)
    assert skewed.item() > 1.5


def test_capacity_keeps_at_most_capacity_choices_per_expert_the_most_probable_first():
    router = _router(router_topk=2, capacity_factor=0.5)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    routing = router(x, batch_size=4)
    kept = routing.indices[routing.keep]
    assert torch.bincount(kept, minlength=4).max() <= router.moe.capacity(32)
    assert (routing.probs[~routing.keep] == 0).all() and not routing.keep.all()
    undropped = torch.softmax(torch.nn.functional.linear(x, router.weight).topk(2).values, -1)
    for e in range(4):  # every choice an expert keeps is at least as probable as every one it drops
        mine = routing.indices == e
        if (mine & ~routing.keep).any():
            assert undropped[mine & routing.keep].min() >= undropped[mine & ~routing.keep].max()


def test_expert_bias_moves_towards_an_even_load():
    router = _router(enable_expert_bias=True, bias_update_rate=0.1)
    router.train()
    router.local_tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    update_expert_bias([router], None)
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])
    assert router.local_tokens_per_expert.sum() == 0
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32


def test_the_bias_changes_the_choice_but_not_the_weights():
    router = _router(enable_expert_bias=True, router_topk=1, score_function="sigmoid")
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    before = router(x, 1)
    router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    after = router(x, 1)
    assert (after.indices == 0).all() and not (before.indices == 0).all()
    scores = torch.sigmoid(torch.nn.functional.linear(x, router.weight))
    torch.testing.assert_close(after.probs.flatten(), scores[:, 0])  # the unbiased score (top-1: not normalised)


def test_stats_average_losses_and_report_imbalance_per_layer():
    stats = MoEStats(num_layers=3, num_experts=4)
    stats.record(0, {"load_balancing_loss": torch.tensor(2.0)}, torch.tensor([4, 4, 4, 4]))
    stats.record(0, {"load_balancing_loss": torch.tensor(4.0)}, torch.tensor([4, 4, 4, 4]))
    stats.record(2, {"load_balancing_loss": torch.tensor(6.0)}, torch.tensor([8, 0, 0, 0]))
    out = stats.reduce_and_reset(None, torch.device("cpu"))
    assert out["load_balancing_loss"] == pytest.approx((3.0 + 6.0) / 2)
    assert out["min_load_imbalance"] == pytest.approx(1.0) and out["max_load_imbalance"] == pytest.approx(4.0)
    assert out["load_imbalance/layer2"] == pytest.approx(4.0) and "load_imbalance/layer1" not in out
    assert stats.reduce_and_reset(None, torch.device("cpu")) == {}


def test_active_parameters_count_the_top_k_experts_only():
    from megatron.core.transformer_config import TransformerConfig

    moe = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=24, layer_freq=2)
    cfg = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8, padded_vocab_size=64,
                            swiglu=True, moe=moe)
    idle_experts_per_layer = (8 - 2) * 3 * 16 * 24
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == 2 * idle_experts_per_layer  # layers 0 and 2
    dense = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8, padded_vocab_size=64,
                              swiglu=True)
    assert dense.num_parameters(active=True) == dense.num_parameters()
    assert cfg.flops_per_token() < 6 * cfg.num_parameters() + 12 * 4 * 8 * 16
