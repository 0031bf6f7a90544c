"""Tensor-parallel layers and the mesh against their single-process equivalents."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tests.dist_utils import run_distributed


def _init(seed):
    def init(t):
        t.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return init


def _tp_layers(rank, world, tp):
    ps.initialize_model_parallel(tp, 1)
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    ids = torch.randint(0, 16, (3, 5))
    target = torch.randint(0, 16, (3, 5))
    col = ColumnParallelLinear(8, 12, init_method=_init(1))
    row = RowParallelLinear(12, 8, init_method=_init(2))
    emb = VocabParallelEmbedding(16, 8, init_method=_init(3))
    head = ColumnParallelLinear(8, 16, bias=False, init_method=_init(4))
    with torch.no_grad():
        col.bias.fill_(0.1)
        row.bias.fill_(-0.2)
    h = row(torch.tanh(col(x + emb(ids))))
    loss = vocab_parallel_cross_entropy(head(h), target).mean()
    loss.backward()
    return {"loss": loss.item(), "x_grad": x.grad, "col_w_grad": col.weight.grad, "row_w_grad": row.weight.grad,
            "emb_grad": emb.weight.grad, "row_b_grad": row.bias.grad, "tp_rank": ps.get_tensor_model_parallel_rank()}


@pytest.mark.multiprocess
def test_tp2_layers_match_single_process():
    ref = run_distributed(_tp_layers, 1, 1)[0]
    outs = run_distributed(_tp_layers, 2, 2)
    for out in outs:
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        torch.testing.assert_close(out["x_grad"], ref["x_grad"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["row_b_grad"], ref["row_b_grad"], rtol=1e-5, atol=1e-6)
    col = torch.cat([o["col_w_grad"] for o in outs], dim=0)
    row = torch.cat([o["row_w_grad"] for o in outs], dim=1)
    emb = torch.cat([o["emb_grad"] for o in outs], dim=0)
    torch.testing.assert_close(col, ref["col_w_grad"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row, ref["row_w_grad"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(emb, ref["emb_grad"], rtol=1e-5, atol=1e-6)


def _vocab_ce(rank, world):
    ps.initialize_model_parallel(world, 1)
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 20, requires_grad=True)
    target = torch.randint(0, 20, (4, 6))
    ref = F.cross_entropy(logits.view(-1, 20), target.view(-1), reduction="none").view(4, 6)
    (ref * torch.arange(24.0).view(4, 6)).sum().backward()
    ref_grad = logits.grad.clone()
    part = logits.detach().chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(part, target)
    (loss * torch.arange(24.0).view(4, 6)).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part.grad, ref_grad.chunk(world, dim=-1)[rank], rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.multiprocess
def test_vocab_parallel_cross_entropy_matches_torch():
    assert all(run_distributed(_vocab_ce, 2))


def _groups(rank, world, tp, pp):
    ps.initialize_model_parallel(tp, pp)
    return {"tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
            "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
            "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
            "next": ps.get_pipeline_model_parallel_next_rank(), "prev": ps.get_pipeline_model_parallel_prev_rank(),
            "emb": ps.get_embedding_group() is not None}


@pytest.mark.multiprocess
def test_rank_order_tp_fastest_then_dp_then_pp():
    outs = run_distributed(_groups, 8, 2, 2)
    for rank, o in enumerate(outs):
        assert o["tp"] == (rank % 2, 2)
        assert o["dp"] == ((rank // 2) % 2, 2)
        assert o["pp"] == (rank // 4, 2)
        assert o["next"] == (rank + 4) % 8 and o["prev"] == (rank - 4) % 8
        assert o["emb"]


def test_mesh_that_does_not_divide_is_a_clear_error():
    with pytest.raises(ps.ParallelConfigError, match="not divisible by tensor-parallel size 2 x pipeline"):
        ps.mesh_sizes(6, 2, 2)
