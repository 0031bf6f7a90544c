"""GPT model: parameter count formula, document-reset masking, rotary positions."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.moe.config import MoEConfig
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
                                     "untie_embeddings_and_output_weights": True},
                                {"swiglu": True, "add_qkv_bias": True, "add_bias_linear": False,
                                 "moe": MoEConfig(4, ffn_hidden_size=24, layer_freq=(0, 1),
                                                  shared_expert_intermediate_size=16, shared_expert_gate=True)},
                                {"moe": MoEConfig(4, shared_expert_intermediate_size=16)}],
                         ids=["gpt2", "llama-gqa", "qwen-moe", "gpt2-moe"])
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


def _fused_and_plain_under_engine(rank, world, kw):
    import zero_cache
    ps.initialize_model_parallel(1, 1)
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    out = {}
    for fusion in (True, False):
        torch.manual_seed(0)
        model = _model(gradient_accumulation_fusion=fusion, **kw).train()
        autograd_grads = {}  # hooks registered before the engine's see param.grad as autograd left it
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.register_post_accumulate_grad_hook(
                    lambda p, n=name, seen=autograd_grads: seen.update({n: p.grad is not None}))
        config = {"train_batch_size": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine = zero_cache.initialize(model=model, config=config)
        losses = engine(tokens[:, :-1], torch.arange(12).unsqueeze(0), labels=tokens[:, 1:])
        engine.backward(losses.mean())
        out[fusion] = (losses.mean().item(), engine.step().grad_norm, autograd_grads,
                       {k: v.numpy() for k, v in engine.gather_state_dict().items()})
        engine.close()
    return out


@pytest.mark.parametrize("kw", [{}, {"untie_embeddings_and_output_weights": True, "swiglu": True}],
                         ids=["tied", "untied"])
def test_linear_and_embedding_weight_gradients_go_to_the_engine(kw):
    """Under the ZeRO engine every linear and embedding weight's gradient is written by the layer into the
    engine's buffer (autograd produces none), with the losses, gradient norm and updated weights of autograd's
    way."""
    out = run_distributed(_fused_and_plain_under_engine, 1, kw)[0]
    (loss, norm, fused_grads, weights), (ref_loss, ref_norm, plain_grads, ref_weights) = out[True], out[False]
    assert fused_grads and not any(fused_grads.values()), fused_grads
    assert plain_grads.keys() == fused_grads.keys() and all(plain_grads.values())
    assert loss == ref_loss and abs(norm - ref_norm) <= 1e-5 * ref_norm
    for k, v in ref_weights.items():
        torch.testing.assert_close(torch.as_tensor(weights[k]), torch.as_tensor(v), rtol=1e-5, atol=1e-5)


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under ``t``'s storage that are in memory (mincore(2))."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    start = t.untyped_storage().data_ptr()
    lo = start - start % page
    length = start + t.untyped_storage().nbytes() - lo
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * page


def _reduce_buffer_residency(rank, world):
    import zero_cache
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    # Tied: the output layer's weight is the embedding's, the first gradient of a backward pass. Chunks of
    # 4 MiB and more, so that the buffers are mappings of their own (zero_cache/host_memory.py).
    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=16,
                            padded_vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg).train()
    config = {"train_batch_size": 4 * world, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    engine = zero_cache.initialize(model=model, config=config)
    tokens = torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        for _ in range(2):
            engine.backward(engine(tokens[:, :-1], torch.arange(16).unsqueeze(0), labels=tokens[:, 1:]).mean())
        engine.step()
    chunks = sorted(c.plan.padded * 4 for c in engine.chunks)
    return chunks, [_resident_bytes(t) for t in engine.reducer.spare.free]


def test_reduce_buffers_keep_the_pages_of_the_chunks_they_serve():
    """The reduction buffers are as large as the largest chunk and reused by every chunk: the largest takes the
    buffer it already used, so a small chunk's buffer never gets the large one's pages too. Two ranks: a
    one-rank group reduces in its gradient shard, with no buffer."""
    chunk_bytes, resident = run_distributed(_reduce_buffer_residency, 2)[0]
    assert len(chunk_bytes) == 2 and len(resident) == 2
    assert sum(resident) <= sum(chunk_bytes) + 2 * 2 * 4096, (chunk_bytes, resident)
