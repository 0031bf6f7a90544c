"""Mixture-of-experts training on expert-parallel meshes equals the single-process run (fp32, dropout off).

A tiny MoE GPT (4 experts, top-2, SwiGLU, load-balancing and z-loss) trains 10 steps on EP2 x DP2, EP2 x TP2,
EP2 x PP2 x DP2 (8 ranks) and under ZeRO-1/2/3 (host memory, SSD page files) with experts sharded over the
expert-data-parallel ranks; losses and final weights (all experts reassembled from their EP blocks, the expert
bias included) equal one process's within 1e-5. The shared expert, the capacity factor (token dropping) and the
aux-loss-free expert bias each ride on one of the meshes. Further:

- an expert that gets no token for several steps, and an EP rank whose local experts get none at all, still
  take AdamW's exact update (weight decay; momentum from the steps it was used): the routers are steered the
  same way in the reference and on the mesh, and the idle expert's weights are checked against AdamW's formula;
- the load-balancing loss and the expert bias measurably even the load (max/mean tokens per expert of the log
  line) against training without either.
"""
from __future__ import annotations

import collections
import json
import math

import pytest
import torch

from tests.training.parallel_harness import (
    TINY_GPT,
    _train_rank,
    assert_same_training,
    check_matches_reference,
    ds_config_flags,
    reference,
    train,
)

pytestmark = pytest.mark.multiprocess

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001"]
SHARED_EXPERT = MOE + ["--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"]
CAPACITY = MOE + ["--moe-expert-capacity-factor", "0.5"]  # half an even share: many tokens are dropped
EXPERT_BIAS = MOE + ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]

EP2 = ["--expert-model-parallel-size", "2"]
EP2_TP2 = EP2 + ["--tensor-model-parallel-size", "2"]
EP2_PP2 = EP2 + ["--pipeline-model-parallel-size", "2"]


# ---- equivalence ----------------------------------------------------------------------------------------------
def test_ep2_dp2_matches_single_process():
    """4 ranks: two expert-parallel pairs, each expert's gradient reduced over the 2 ranks that hold it."""
    outs = check_matches_reference(MOE, EP2, 4)
    assert {(o["dp"], o["ep"]) for o in outs} == {(0, 0), (1, 1), (2, 0), (3, 1)}


def test_ep2_tp2_shared_expert_matches_single_process():
    """Experts split over EP and their ffn over TP; the gated shared expert is a TP-parallel dense MLP."""
    outs = check_matches_reference(SHARED_EXPERT, EP2_TP2, 4)
    assert any("shared_experts.gate_weight" in n for n in outs[0]["params"])


def test_ep2_pp2_dp2_matches_single_process():
    """8 ranks: each pipeline stage has its own expert-parallel and expert-data-parallel groups."""
    check_matches_reference(MOE, EP2_PP2, 8)


def test_zero3_experts_on_ssd_with_capacity_factor_ep2_dp2_matches_single_process(tmp_path):
    """ZeRO-3 with parameters and optimizer states in SSD page files; expert chunks are sharded over the
    expert-data-parallel group. Tokens over an expert's capacity are dropped on the rank that routed them."""
    check_matches_reference(CAPACITY, EP2 + ds_config_flags(tmp_path, 3, nvme=True), 4)
    # The capacity did drop tokens: the same run without it trains the experts differently (measured: 0.04 of
    # weights up to 0.09; the loss of this tiny model moves by 3e-4 only).
    name = "decoder.layers.0.mlp.experts.linear_fc2.weight"
    assert (reference(tuple(CAPACITY))[1][name] - reference(tuple(MOE))[1][name]).abs().max() > 1e-2
    swap = tmp_path / "swap" / "zero_cache_swap"
    assert swap.is_dir() and not list(swap.iterdir())  # the page files were used, and removed at exit


def test_zero1_expert_bias_ep2_matches_single_process(tmp_path):
    """ZeRO-1 on EP2 (each expert-data-parallel group is one rank) with the aux-loss-free expert bias, whose
    per-expert counts are summed over the data-parallel ranks after every step; the biases are compared too."""
    biases = {n: t for n, t in reference(tuple(EXPERT_BIAS))[1].items() if n.endswith("router.expert_bias")}
    assert len(biases) == 4 and all(t.abs().max() > 0 for t in biases.values())  # they moved
    check_matches_reference(EXPERT_BIAS, EP2 + ds_config_flags(tmp_path, 1), 2)


# ---- idle experts ---------------------------------------------------------------------------------------------
# The routers are steered identically in the reference and on the mesh: in layer 1, experts 2 and 3 (the whole
# block of EP rank 1) never get a token; in layer 0, expert 3 gets none from step 6 on.
IDLE_ALWAYS = {1: (2, 3)}
IDLE_FROM_STEP_6 = {0: (3,)}
_state = {"step": 0, "layer": None, "counts": collections.Counter(), "model": None, "snapshots": {}}


def _steered_rank(rank: int, world: int, argv: list[str]) -> dict:
    """``_train_rank`` with the routers steered (see above); also returns the tokens each (iteration, layer,
    expert) got on this rank, and on a one-process DDP run the idle experts' weights at start and after step 5."""
    import pretrain_gpt
    from megatron.core.moe import layer as moe_layer
    from megatron.core.moe.router import TopKRouter
    from megatron.training import training

    top_k, forward, update, provider = (TopKRouter._top_k, moe_layer.MoELayer.forward, training.update_expert_bias,
                                        pretrain_gpt.model_provider)

    def layer_forward(self, x):
        _state["layer"] = self.layer_number
        return forward(self, x)

    def steered_top_k(self, logits):
        step, layer = _state["step"], _state["layer"]
        idle = IDLE_ALWAYS.get(layer, ()) + (IDLE_FROM_STEP_6.get(layer, ()) if step >= 5 else ())
        if idle:
            mask = torch.zeros(logits.shape[-1])
            mask[list(idle)] = -1e4
            logits = logits + mask
        probs, indices = top_k(self, logits)
        if self.training and torch.is_grad_enabled():
            for e, n in enumerate(torch.bincount(indices.reshape(-1), minlength=logits.shape[-1]).tolist()):
                _state["counts"][(step + 1, layer, e)] += n
        return probs, indices

    def counted_update(routers, group):
        update(routers, group)
        _state["step"] += 1
        if _state["step"] == 5:
            _snapshot("after5")

    def recording_provider(config, rng_tracker):
        model = provider(config, rng_tracker)
        _state["model"] = model
        _snapshot("init")
        return model

    TopKRouter._top_k, moe_layer.MoELayer.forward = steered_top_k, layer_forward
    training.update_expert_bias, pretrain_gpt.model_provider = counted_update, recording_provider
    out = _train_rank(rank, world, argv)
    out["counts"], out["snapshots"] = dict(_state["counts"]), _state["snapshots"]
    return out


def _snapshot(when: str) -> None:
    """The whole stacked fc1 weight of layers 0 and 1 (a one-process DDP run holds every expert, in memory)."""
    import torch.distributed as dist

    from megatron.core.moe.layer import MoELayer

    if dist.get_world_size() > 1:
        return
    for m in _state["model"].modules():
        if isinstance(m, MoELayer) and m.layer_number in (0, 1):
            _state["snapshots"][(when, m.layer_number)] = m.experts.linear_fc1.weight.detach().clone()


_steered_reference = {}


def steered_reference():
    if not _steered_reference:
        _steered_reference["run"] = train(TINY_GPT + MOE, 1, rank_fn=_steered_rank)
    return _steered_reference["run"]


def test_idle_experts_get_adamw_updates_zero2_offload_ep2_dp2(tmp_path):
    ref_losses, ref_params, ref_outs = steered_reference()
    counts = ref_outs[0]["counts"]
    per_step = {(it, layer, e): counts.get((it, layer, e), 0) for it in range(1, 11) for layer in (0, 1)
                for e in range(4)}
    # The steering did what it says: idle where intended, used everywhere else (and expert 3 of layer 0 before).
    assert all(per_step[(it, 1, e)] == 0 for it in range(1, 11) for e in (2, 3))
    assert all(per_step[(it, 0, 3)] == 0 for it in range(6, 11))
    assert all(per_step[(it, 0, 3)] > 0 for it in range(1, 6))

    lrs, wd = ref_outs[0]["lrs"], 0.1
    snaps = ref_outs[0]["snapshots"]
    decay = math.prod(1 - lrs[it] * wd for it in range(1, 11))
    final = ref_params["decoder.layers.1.mlp.experts.linear_fc1.weight"]
    # Never used: zero gradients, zero moments, so AdamW only decays the weights.
    torch.testing.assert_close(final[2:], snaps[("init", 1)][2:] * decay, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(final[:2], snaps[("init", 1)][:2] * decay, atol=1e-4)  # the used ones trained
    # Idle from step 6: still moved by the momentum of steps 1-5, beyond the decay alone.
    late_decay = math.prod(1 - lrs[it] * wd for it in range(6, 11))
    final0 = ref_params["decoder.layers.0.mlp.experts.linear_fc1.weight"][3]
    assert (final0 - snaps[("after5", 0)][3] * late_decay).abs().max() > 1e-4

    zero2_offload = tmp_path / "zero2_offload.json"
    zero2_offload.write_text(json.dumps({"zero_optimization": {
        "stage": 2, "allgather_bucket_size": 3000, "offload_optimizer": {"device": "cpu"}}}))
    losses, params, outs = train(TINY_GPT + MOE + EP2 + ["--deepspeed", "--deepspeed_config", str(zero2_offload)], 4,
                                 rank_fn=_steered_rank)
    assert_same_training(losses, params, ref_losses, ref_params, what="zero2-offload-ep2dp2")
    # On the mesh, EP rank 1 of layer 1 received no row at all in any micro-batch (its experts are 2 and 3).
    for o in outs:
        assert sum(o["counts"].get((it, 1, e), 0) for it in range(1, 11) for e in (2, 3)) == 0


# ---- load balancing -------------------------------------------------------------------------------------------
_logged: dict[int, dict] = {}


def _logging_rank(rank: int, world: int, argv: list[str]) -> dict:
    """``_train_rank``, also returning what every log line reported of the MoE layers (by iteration)."""
    from megatron.training import train_log

    log = train_log.TrainLogger.log

    def recording_log(self, iteration, *args, moe=None, **kwargs):
        _logged[iteration] = moe
        return log(self, iteration, *args, moe=moe, **kwargs)

    train_log.TrainLogger.log = recording_log
    out = _train_rank(rank, world, argv)
    out["moe_log"] = dict(_logged)
    return out


def test_load_balancing_evens_the_expert_load():
    """Top-1 of 4 experts: without balancing, the router sends most tokens to a few experts. Over steps 11-20 the
    load-balancing loss (coefficient 1) and the expert bias each bring the most loaded expert of every layer
    close to an even share."""
    top1 = ["--num-experts", "4", "--moe-router-topk", "1", "--swiglu", "--train-iters", "20",
            "--log-interval", "10"]
    runs = {}
    for name, extra in {"none": [], "aux": ["--moe-aux-loss-coeff", "1"],
                        "bias": ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]}.items():
        _, _, outs = train(TINY_GPT + top1 + extra, 1, rank_fn=_logging_rank)
        runs[name] = outs[0]["moe_log"][20]
    # max/mean tokens per expert (1 = even, 4 = one expert takes everything), of the least / most imbalanced
    # layer. Measured: none 1.89-3.01, aux 1.05-1.12, bias 1.14-1.37.
    assert runs["none"]["min_load_imbalance"] > 1.7, runs
    assert runs["aux"]["max_load_imbalance"] < 1.25, runs
    assert runs["bias"]["max_load_imbalance"] < min(1.5, runs["none"]["min_load_imbalance"] - 0.3), runs
    assert "load_balancing_loss" in runs["aux"] and "load_balancing_loss" not in runs["none"]
