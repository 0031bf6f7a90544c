"""Several shard groups in one engine: dense parameters sharded over all 4 ranks, expert parameters over pairs.

The model emulates expert parallelism (EP 2 inside DP 4): each rank holds one of two experts, every token
passes through both, and the expert-parallel pair {0,1} or {2,3} exchanges activations with autograd-aware
all-gathers. An expert's gradient then covers the tokens of its expert-parallel pair, so the expert-data-
parallel pair that shards it ({0,2} or {1,3}) sums it and scales by 1/4, the data-parallel size (Megatron-core's
rule). One step, one global norm (clipping is active), one checkpoint: losses and weights equal the single-process
reference, and the checkpoint loads into one process holding both experts.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    BETAS,
    EPS,
    HIDDEN,
    LR,
    STEPS,
    VOCAB,
    WD,
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    rank_micro_batches,
    to_numpy,
)
from zero_cache.checkpoint.geometry import GlobalSlice

pytestmark = pytest.mark.multiprocess

WORLD, EXPERTS = 4, 2
CLIP = 0.5  # below every step's norm: clipping mixes the groups' gradients into one coefficient


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; the backward sums every rank's gradient of this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size)[ctx.rank], None


class ExpertGPT(nn.Module):
    """Embedding, a layer of experts every token passes through (summed), a norm and an output head.

    ``local``: the experts this process holds (all of them for the reference); ``ep_group``: the expert-
    parallel group whose tokens the local experts see (None: one process)."""

    def __init__(self, local: list[int], ep_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        experts = [nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS)]
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.experts = nn.ModuleList(experts[e] for e in local)
        self.ep_group = ep_group

    def forward(self, tokens):
        x = self.embed(tokens[:, :-1])
        if self.ep_group is None:
            y = sum(F.gelu(e(x)) for e in self.experts)
        else:  # each rank applies its expert to the pair's tokens; the pair's outputs are summed per token
            ep, rank = dist.get_world_size(self.ep_group), dist.get_rank(self.ep_group)
            out = _GatherTokens.apply(F.gelu(self.experts[0](_GatherTokens.apply(x, self.ep_group))), self.ep_group)
            y = out.view(ep, ep, *x.shape).sum(0)[rank]
        logits = self.head(self.ln(x + y))
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _expert_layout(expert_of_local):
    """Checkpoint layout: local expert i is global expert ``expert_of_local(i)`` in one stacked tensor."""
    def layout(name: str, shape: tuple[int, ...]) -> GlobalSlice:
        if not name.startswith("experts."):
            return GlobalSlice.whole(name, shape)
        _, i, leaf = name.split(".")
        e = expert_of_local(int(i))
        rows = shape[0]
        return GlobalSlice(f"experts.{leaf}", (EXPERTS * rows, *shape[1:]), (e * rows,) + (0,) * (len(shape) - 1))
    return layout


def _reference():
    model = ExpertGPT(list(range(EXPERTS)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data, losses, norms = batches(STEPS), [], []
    for s in range(STEPS):
        loss = model(data[s])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(tier: str, nvme: str) -> dict:
    cfg = ds_config(3, WORLD, offload=tier == "host") | {"gradient_clipping": CLIP}
    if tier == "ssd":
        for key in ("offload_optimizer", "offload_param"):
            cfg["zero_optimization"][key] = {"device": "nvme", "nvme_path": nvme}
    return cfg


def _worker(rank, world_size, tier, nvme, ckpt):
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    expert = rank % EXPERTS
    model = ExpertGPT([expert], ep_groups[rank // EXPERTS])
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
    engine = zero_cache.initialize(model=model, config=_config(tier, f"{nvme}/{rank}"), param_groups=[
        {"params": dense},
        {"params": list(model.experts.parameters()), "dp_group": edp_groups[expert],
         "gradient_scaling_factor": 1.0 / world_size}])
    sizes = sorted({c.comm.size for c in engine.chunks})
    data, losses, norms = batches(STEPS), [], []
    for s in range(STEPS):
        micro = []
        for mb in rank_micro_batches(data[s], rank, world_size):
            loss = engine(mb)
            micro.append(loss.item())
            engine.backward(loss)
        norms.append(engine.step().grad_norm)
        losses.append(sum(micro) / len(micro))
    weights = to_numpy(engine.gather_state_dict(rank0_only=False))
    engine.save_checkpoint(ckpt, layout=_expert_layout(lambda i: expert))
    engine.close()
    return losses, norms, weights, sizes


@pytest.mark.parametrize("tier", ["host", "ssd"])
def test_two_shard_groups_match_the_reference_and_reshard_on_load(tmp_path, tier):
    ref_losses, ref_norms, ref_weights = _reference()
    ckpt = str(tmp_path / "ckpt")
    out = run_distributed(_worker, WORLD, tier, str(tmp_path / "nvme"), ckpt)
    assert all(sizes == [2, 4] for *_, sizes in out)  # the experts' chunks over pairs, the rest over all 4
    # Each rank's loss is the mean over its quarter of the global batch: their mean is the reference loss.
    assert_close_losses([sum(r[0][s] for r in out) / WORLD for s in range(STEPS)], ref_losses)
    assert min(ref_norms) > CLIP  # every step clips: the experts' gradient scale reaches every weight
    for _, norms, _, _ in out:  # one global norm, over both groups
        assert_close_losses(norms, ref_norms)
    for rank, (_, _, weights, _) in enumerate(out):
        expected = {k: v for k, v in ref_weights.items() if not k.startswith("experts.")}
        mine = rank % EXPERTS
        expected |= {f"experts.0.{leaf}": ref_weights[f"experts.{mine}.{leaf}"] for leaf in ("weight", "bias")}
        assert_close_weights(weights, expected)

    # The 4-rank, two-group checkpoint loads into one process holding both experts in one group.
    engine = zero_cache.initialize(model=ExpertGPT(list(range(EXPERTS))), config=ds_config(3, 1))
    engine.load_checkpoint(ckpt, layout=_expert_layout(lambda i: i))
    assert_close_weights(engine.gather_state_dict(), ref_weights)
    engine.close()


def _outside_worker(rank, world_size):
    pairs = [dist.new_group([0]), dist.new_group([1])]
    model = ExpertGPT([0])
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
    try:  # the engine's group is this rank alone; the experts' group spans both ranks
        zero_cache.initialize(model=model, config=ds_config(3, 1), dp_group=pairs[rank], param_groups=[
            {"params": dense}, {"params": list(model.experts.parameters()), "dp_group": dist.group.WORLD}])
    except zero_cache.ZeroConfigError as e:
        return str(e)
    return "accepted"


def test_a_shard_group_outside_the_engine_group_is_one_error():
    for message in run_distributed(_outside_worker, 2):
        assert "param_groups[1]'s dp_group holds ranks" in message and "outside the engine's dp_group" in message
