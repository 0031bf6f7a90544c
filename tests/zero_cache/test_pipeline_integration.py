"""The trainer's pattern: 2 pipeline stages x DP 2, intermediate stage backward via torch.autograd.backward,
several micro-batch forwards in flight before their backwards, a word embedding tied across the first and last
stage (tied_param_groups), grad norm over the model-parallel group with the duplicate excluded."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    STEPS,
    assert_close_losses,
    batches,
    ds_config,
    make_model,
    rank_micro_batches,
    reference_run,
)

pytestmark = pytest.mark.multiprocess

PP, DP = 2, 2


class FirstStage(nn.Module):
    def __init__(self, full):
        super().__init__()
        self.embed, self.block = full.embed, full.blocks[0]

    def forward(self, tokens):
        return self.block(self.embed(tokens[:, :-1]))


class LastStage(nn.Module):
    def __init__(self, full):
        super().__init__()
        self.block, self.ln_f, self.head = full.blocks[1], full.ln_f, full.head
        self.word_embeddings = nn.Parameter(full.embed.weight.detach().clone())  # the tied copy

    def forward(self, x, tokens):
        logits = self.head(self.ln_f(self.block(x)), self.word_embeddings)
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _pipeline(rank, world_size):
    pp_rank, dp_rank = divmod(rank, DP)
    dp_groups = [dist.new_group([p * DP + d for d in range(DP)]) for p in range(PP)]
    pp_groups = [dist.new_group([p * DP + d for p in range(PP)]) for d in range(DP)]
    out = {stage: _train_stage(rank, stage, dp_groups[pp_rank], pp_groups[dp_rank]) for stage in (2, 3)}
    # Stage 3 with a max_contigous_params_size arena of two chunks: with every micro-batch's forward in flight
    # before the backwards, chunks are evicted and re-gathered while autograd holds views of them.
    out["3-arena"] = _train_stage(rank, 3, dp_groups[pp_rank], pp_groups[dp_rank], max_contigous_params_size=2304)
    return out


def _train_stage(rank, zero_stage, dp_group, pp_group, **zero):
    pp_rank, dp_rank = divmod(rank, DP)
    full = make_model()
    stage = FirstStage(full) if pp_rank == 0 else LastStage(full)
    tied = stage.embed.weight if pp_rank == 0 else stage.word_embeddings
    engine = zero_cache.initialize(
        model=stage, config=ds_config(zero_stage, DP, **zero), dp_group=dp_group, model_parallel_group=pp_group,
        param_in_grad_norm=lambda p: pp_rank == 0 or p is not tied, tied_param_groups=[(tied, pp_group)])
    if pp_rank == 1:
        engine.register_external_parameter(stage.head, stage.word_embeddings)
    peer = rank + DP if pp_rank == 0 else rank - DP
    data = batches()
    losses, norms = [], []
    for s in range(STEPS):
        micro = rank_micro_batches(data[s], dp_rank, DP)
        outputs, step_losses = [], []
        for mb in micro:  # all forwards first: several micro-batches in flight
            if pp_rank == 0:
                x = engine(mb)
                dist.send(x.detach(), peer)
                outputs.append(x)
            else:
                x = torch.empty(mb.shape[0], mb.shape[1] - 1, full.embed.embedding_dim)
                dist.recv(x, peer)
                x.requires_grad_()
                loss = engine(x, mb)
                step_losses.append(loss.item())
                outputs.append((x, loss))
        for out in outputs:
            if pp_rank == 0:
                grad = torch.empty_like(out)
                dist.recv(grad, peer)
                torch.autograd.backward(out, grad_tensors=grad)  # not engine.backward: hooks must drive it
            else:
                x, loss = out
                engine.backward(loss)
                dist.send(x.grad, peer)
        result = engine.step()
        norms.append(result.grad_norm)
        losses.append(sum(step_losses) / len(step_losses) if step_losses else None)
    tied_name = "embed.weight" if pp_rank == 0 else "word_embeddings"
    tied_final = engine.gather_state_dict(rank0_only=False)[tied_name].numpy()
    return losses, norms, tied_final


def _check(results):
    ref_norms = []
    ref_losses, ref_weights = reference_run(norms=ref_norms)
    last = [results[PP * DP - DP + d] for d in range(DP)]
    losses = [sum(r[0][s] for r in last) / DP for s in range(STEPS)]
    assert_close_losses(losses, ref_losses)
    for r in results:
        assert_close_losses(r[1], ref_norms)
    for r in results:  # both copies of the tied embedding stay equal to the reference
        torch.testing.assert_close(torch.as_tensor(r[2]), ref_weights[-1]["embed.weight"], atol=1e-5, rtol=1e-5)


def test_pipeline_stages_2_and_3_match_reference():
    results = run_distributed(_pipeline, PP * DP, timeout=300)
    for variant in (2, 3, "3-arena"):
        _check([r[variant] for r in results])
