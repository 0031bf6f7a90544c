"""DistributedDataParallel: contiguous grad buffer, bucketed all-reduce overlapped with backward."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.dist_utils import run_distributed
from tests.zero_cache.common import FusedEmbedding, FusedLinear

VOCAB, HIDDEN = 16, 8


class TiedLM(nn.Module):
    """Embedding whose weight is reused by the output layer (one Parameter used twice per backward)."""

    def __init__(self, recompute: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.norm = nn.LayerNorm(HIDDEN)
        self.recompute = recompute
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, tokens, labels):
        x = self.embedding(tokens)
        x = checkpoint(self.mlp, x, use_reentrant=False) if self.recompute else self.mlp(x)
        logits = self.norm(x) @ self.embedding.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data(n=8, seq=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, seq), generator=g), torch.randint(0, VOCAB, (n, seq), generator=g)


def _train_step(ddp, opt, tokens, labels, micro_batches):
    """Megatron's step protocol: no_sync for all but the last micro-batch, loss / micro-batches."""
    opt.zero_grad()
    for i, (t, lab) in enumerate(zip(tokens.chunk(micro_batches), labels.chunk(micro_batches))):
        last = i == micro_batches - 1
        with ddp.no_sync() if not last else torch.enable_grad():
            (ddp(t, lab) / micro_batches).backward()
    ddp.finish_grad_sync()
    return opt.step()


# ----- data parallel == single process -----

def _dp_worker(rank, world_size):
    ps.initialize_model_parallel(1, 1)
    cfg = OptimizerConfig(lr=1e-2, clip_grad=0.5)
    model = TiedLM()
    ddp = DistributedDataParallel(model, ps.get_data_parallel_group(), bucket_size=40)
    opt = get_megatron_optimizer(cfg, [ddp], ps.get_data_parallel_group(), ps.get_model_parallel_group())
    ref = TiedLM()
    ref_opt = get_megatron_optimizer(cfg, [ref], None, None)
    grad_err, param_err, norms = 0.0, 0.0, []
    for step in range(2):
        tokens, labels = _data(seed=step)
        half = slice(rank * 4, rank * 4 + 4)
        ok, norm, _ = _train_step(ddp, opt, tokens[half], labels[half], micro_batches=2)
        ref_opt.zero_grad()
        ref(tokens, labels).backward()
        ref_grads = [p.grad.clone() for p in ref.parameters()]
        ref_ok, ref_norm, _ = ref_opt.step()
        for p, q, g in zip(model.parameters(), ref.parameters(), ref_grads):
            grad_err = max(grad_err, float((p.main_grad / (min(1.0, 0.5 / (norm + 1e-6))) - g).abs().max()))
            param_err = max(param_err, float((p.detach() - q.detach()).abs().max()))
        norms.append((ok, norm, ref_ok, ref_norm))
    return len(ddp.buckets), grad_err, param_err, norms, _bf16_dp_grads_match(rank)


def _bf16_dp_grads_match(rank):
    """16-bit params: each micro-batch's bf16 grad is summed in fp32, then averaged over ranks."""
    model = TiedLM().to(torch.bfloat16)
    ddp = DistributedDataParallel(model, ps.get_data_parallel_group(), bucket_size=40)
    tokens, labels = _data()
    quarters = list(zip(tokens.chunk(4), labels.chunk(4)))
    for i, (t, lab) in enumerate(quarters[2 * rank:2 * rank + 2]):
        with ddp.no_sync() if i == 0 else torch.enable_grad():
            (ddp(t, lab) / 2).backward()
    ddp.finish_grad_sync()
    ref = TiedLM().to(torch.bfloat16)
    per_rank = []
    for r in range(2):
        acc = [torch.zeros(p.shape) for p in ref.parameters()]
        for t, lab in quarters[2 * r:2 * r + 2]:
            ref.zero_grad()
            (ref(t, lab) / 2).backward()
            acc = [a + q.grad.float() for a, q in zip(acc, ref.parameters())]
        per_rank.append(acc)
    expected = [(a + b) / 2 for a, b in zip(*per_rank)]
    return all(p.grad is None and torch.equal(p.main_grad, e) for p, e in zip(model.parameters(), expected))


@pytest.mark.multiprocess
def test_dp2_two_microbatches_equals_single_process_full_batch():
    for n_buckets, grad_err, param_err, norms, bf16_match in run_distributed(_dp_worker, 2):
        assert n_buckets >= 3 and bf16_match
        assert grad_err < 1e-6 and param_err < 1e-6
        for ok, norm, ref_ok, ref_norm in norms:
            assert ok and ref_ok and norm == pytest.approx(ref_norm, rel=1e-6)


# ----- overlap: buckets are reduced while backward is still running -----

def _overlap_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    ddp = DistributedDataParallel(model, dist.group.WORLD, bucket_size=16 * 16 + 16)
    events = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append(("all_reduce", tensor.numel()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    for name, p in model.named_parameters():  # registered after DDP's hooks, so they run after them
        p.register_post_accumulate_grad_hook(lambda _, name=name: events.append(("grad", name)))
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    with ddp.no_sync():
        model(x[:3]).square().mean().backward()
    no_sync_events = list(events)
    events.clear()
    model(x[3:]).square().mean().backward()
    backward_events = list(events)
    ddp.finish_grad_sync()
    dist.all_reduce = real_all_reduce
    return [[p for p in b.params] == [model[3 - i].bias, model[3 - i].weight] for i, b in enumerate(ddp.buckets)], \
        no_sync_events, backward_events, events[len(backward_events):]


@pytest.mark.multiprocess
def test_first_bucket_all_reduce_launches_before_backward_finishes():
    for bucket_layout, no_sync_events, backward_events, after_events in run_distributed(_overlap_worker, 2):
        assert bucket_layout == [True] * 4  # one bucket per layer, last layer first
        assert all(kind == "grad" for kind, _ in no_sync_events) and len(no_sync_events) == 8
        kinds = [kind for kind, _ in backward_events]
        assert kinds.count("all_reduce") == 4 and after_events == []  # all launched during backward
        first_reduce = kinds.index("all_reduce")
        last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
        assert backward_events[last_grad] == ("grad", "0.weight")
        assert first_reduce < last_grad
        # The last layer's bucket is launched from the hook of whichever of its two params arrives second.
        assert first_reduce == 1 and backward_events[1] == ("all_reduce", 16 * 16 + 16)
        assert {backward_events[0], backward_events[2]} == {("grad", "3.bias"), ("grad", "3.weight")}


class _RegisteredBackwards(nn.Module):
    """Registers ``second`` before ``first``: its bucket comes first but its gradient arrives last."""

    def __init__(self):
        super().__init__()
        self.second = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)

    def forward(self, x):
        return self.second(self.first(x))


def test_buckets_launch_in_bucket_order_even_when_ready_out_of_order():
    model = _RegisteredBackwards()
    ddp = DistributedDataParallel(model, None, bucket_size=20)
    assert [b.params for b in ddp.buckets] == [[model.first.bias, model.first.weight],
                                               [model.second.bias, model.second.weight]]
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda _: seen.append([(len(b.ready), b.launched) for b in ddp.buckets]))
    model(torch.randn(3, 4)).sum().backward()
    # The second bucket was complete first but waited for the first: every rank issues the same order.
    assert [(0, False), (2, False)] in seen
    assert seen[-1] == [(2, True), (2, True)]


# ----- single process: buffer semantics -----

def test_fp32_grads_are_views_of_one_buffer_no_extra_copy():
    model = TiedLM()
    ddp = DistributedDataParallel(model, None, bucket_size=50)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [ddp], None, None)
    params = list(model.parameters())
    assert ddp.grad_buffer.numel() == sum(p.numel() for p in params)
    buffer_ptr = ddp.grad_buffer.untyped_storage().data_ptr()

    def check_views():
        for p in params:
            assert p.grad.untyped_storage().data_ptr() == buffer_ptr
            assert p.grad.data_ptr() == p.main_grad.data_ptr()

    check_views()
    for step in range(2):
        _train_step(ddp, opt, *_data(seed=step), micro_batches=2)
        check_views()
    # fp32: the optimizer updates the model params themselves; its only state is Adam's m, v (and step).
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params}
    for p in params:
        state = opt.optimizer.state[p]
        assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape
    opt.zero_grad()
    check_views()
    assert ddp.grad_buffer.abs().sum() == 0


def test_tied_and_recomputed_params_accumulate_once_per_backward():
    model = TiedLM(recompute=True)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, None)
    calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    tokens, labels = _data()
    with ddp.no_sync():
        ddp(tokens[:4], labels[:4]).backward()
    ddp(tokens[4:], labels[4:]).backward()
    ddp.finish_grad_sync()
    ref(tokens[:4], labels[:4]).backward()
    ref(tokens[4:], labels[4:]).backward()
    assert calls == {name: 2 for name, _ in model.named_parameters()}  # once per backward, tied weight included
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.grad, rtol=0, atol=0)


def test_bf16_grads_accumulate_in_fp32_main_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, None)
    x = torch.randn(6, 4).to(torch.bfloat16)
    with ddp.no_sync():
        model(x[:3]).float().square().mean().backward()
    model(x[3:]).float().square().mean().backward()
    ddp.finish_grad_sync()
    expected = [torch.zeros(p.shape) for p in ref.parameters()]
    for part in (x[:3], x[3:]):
        ref.zero_grad()
        ref(part).float().square().mean().backward()
        expected = [e + q.grad.float() for e, q in zip(expected, ref.parameters())]
    for p, e in zip(model.parameters(), expected):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert torch.equal(p.main_grad, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_add_their_weight_gradients_into_main_grad(dtype):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)
    fused = nn.Sequential(FusedEmbedding(5, 4), FusedLinear(4, 8), nn.Tanh(), FusedLinear(8, 2)).to(dtype)
    fused.load_state_dict(plain.state_dict())
    from_autograd = []  # registered before DDP's hooks: param.grad as autograd left it
    for layer in (fused[0], fused[1], fused[3]):
        layer.weight.register_post_accumulate_grad_hook(lambda p: from_autograd.append(p.grad is not None))
    ddps = [DistributedDataParallel(m, None) for m in (plain, fused)]
    x = torch.randint(0, 5, (2, 6), generator=torch.Generator().manual_seed(1))  # repeated ids
    for ddp in ddps:
        with ddp.no_sync():
            ddp(x[:, :3]).float().square().mean().backward()
        ddp(x[:, 3:]).float().square().mean().backward()
        ddp.finish_grad_sync()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        # A 16-bit embedding's rows are summed in main_grad's fp32 when fused, in bf16 by autograd: closer than
        # bf16's resolution, not equal.
        tol = 1e-2 if dtype == torch.bfloat16 and name == "0.weight" else 1e-5
        torch.testing.assert_close(p.main_grad, q.main_grad, rtol=tol, atol=tol / 10)
    if dtype == torch.bfloat16:  # fp32 weights' .grad is main_grad itself either way
        assert from_autograd == [False] * 6


def test_wrapper_is_transparent():
    model = TiedLM()
    ddp = DistributedDataParallel(model, None)
    assert list(ddp.state_dict()) == list(model.state_dict())  # no "module." prefix in checkpoints
    ddp.load_state_dict(model.state_dict())
    marker = torch.ones(1)
    ddp.set_input_tensor(marker)  # attributes the pipeline schedule needs reach the wrapped module
    assert model.input_tensor is marker and ddp.recompute is False
    tokens, labels = _data()
    assert torch.equal(ddp(tokens, labels), model(tokens, labels))


def test_misuse_gives_clear_errors():
    model = TiedLM()
    ddp = DistributedDataParallel(model, None)
    with pytest.raises(ValueError, match="wrapped in DistributedDataParallel twice"):
        DistributedDataParallel(model, None)
    tokens, labels = _data()
    ddp(tokens, labels).backward()
    ddp.finish_grad_sync()
    with pytest.raises(RuntimeError, match="zero_grad_buffer"):
        ddp(tokens, labels).backward()  # next step without clearing gradients
    ddp.zero_grad_buffer()
    model.zero_grad(set_to_none=True)  # detaches .grad from the buffer
    with pytest.raises(RuntimeError, match="no longer lives in the DDP grad buffer"):
        ddp(tokens, labels).backward()
    with pytest.raises(ValueError, match="less precise"):
        DistributedDataParallel(nn.Linear(2, 2), None, grad_dtype=torch.bfloat16)
