"""GPT model: parameter count formula, document-reset masking, rotary positions."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.transformer_config import TransformerConfig
from megatron.data import get_ltor_masks_and_position_ids
from megatron.model.gpt_model import GPTModel
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess


def _model(**kw):
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12,
                            padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    return GPTModel(cfg).eval()


def _reset_mask(rank, world, kw):
    ps.initialize_model_parallel(1, 1)
    model = _model(**kw)
    eod = 0
    doc_a = torch.tensor([5, 6, 7, 8, eod])
    doc_b = torch.tensor([9, 10, 11, 12, 13, 14, 15])
    tokens = torch.cat([doc_a, doc_b]).unsqueeze(0)
    mask, _, pos = get_ltor_masks_and_position_ids(tokens, eod, True, True, False)
    with torch.no_grad():
        packed = model(tokens, pos, mask)
        alone = model(doc_b.unsqueeze(0), torch.arange(7).unsqueeze(0))
        causal = model(tokens, torch.arange(12).unsqueeze(0))
    # With reset masks and positions, the second document is computed exactly as if it stood alone ...
    torch.testing.assert_close(packed[:, 5:], alone, rtol=1e-5, atol=1e-5)
    # ... which plain causal attention over the packed sequence does not do.
    assert not torch.allclose(causal[:, 5:], alone, atol=1e-3)
    return True


@pytest.mark.parametrize("kw", [{}, {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True}],
                         ids=["gpt2", "llama"])
def test_reset_attention_mask_isolates_documents(kw):
    assert run_distributed(_reset_mask, 1, kw)[0]


def _count(rank, world, kw):
    ps.initialize_model_parallel(1, 1)
    model = _model(**kw)
    return sum(p.numel() for p in model.parameters()), model.config.num_parameters()


@pytest.mark.parametrize("kw", [{}, {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                                     "add_bias_linear": False, "num_query_groups": 2,
                                     "untie_embeddings_and_output_weights": True}], ids=["gpt2", "llama-gqa"])
def test_parameter_count_formula(kw):
    actual, formula = run_distributed(_count, 1, kw)[0]
    assert actual == formula


def _deferred_equals_eager(rank, world, kw):
    ps.initialize_model_parallel(world, 1)
    from megatron.core.deferred_init import initial_value
    eager = _model(**kw)
    with torch.device("meta"):
        lazy = _model(**kw)
    eager_params = dict(eager.named_parameters())
    out = {}
    for name, p in lazy.named_parameters():
        assert p.is_meta, name
        out[name] = torch.equal(initial_value(name, p), eager_params[name].detach())
    return out


@pytest.mark.parametrize("kw", [{}, {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                                     "add_bias_linear": False, "untie_embeddings_and_output_weights": True}],
                         ids=["gpt2", "llama"])
def test_meta_built_model_initializes_like_eager(kw):
    """Every parameter built on the meta device carries an initializer that gives the eager weights (TP=2)."""
    for per_rank in run_distributed(_deferred_equals_eager, 2, kw):
        assert per_rank and all(per_rank.values()), [n for n, ok in per_rank.items() if not ok]
