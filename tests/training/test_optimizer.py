"""Megatron optimizers: loss scaling, AdamW equivalence, global-norm clipping (incl. tensor parallel)."""
import argparse
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import (
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_grad_norm_fp32,
    get_megatron_optimizer,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.training.arguments.optimizer import add_optimizer_args, optimizer_config_from_args
from tests.dist_utils import run_distributed


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 3)).to(dtype)


def _batch(seed, dtype=torch.float32, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g).to(dtype), torch.randn(n, 3, generator=g).to(dtype)


# ----- loss scaler -----

def test_dynamic_scaler_hysteresis_backoff_growth_and_floor():
    s = DynamicGradScaler(initial_scale=2.0 ** 16, min_scale=2.0 ** 14, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0 ** 16 and s.hysteresis_tracker == 1  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 2.0 ** 15  # hysteresis spent: halve
    s.update(False), s.update(False)
    assert s.scale == 2.0 ** 15 and s.growth_tracker == 2
    s.update(True)  # overflow resets the growth count; hysteresis still spent, so halve again
    assert s.scale == 2.0 ** 14 and s.growth_tracker == 0
    s.update(True)
    assert s.scale == 2.0 ** 14  # floor
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0 ** 15 and s.hysteresis_tracker == 2  # growth restores hysteresis
    restored = DynamicGradScaler(1.0, 1.0, growth_interval=3, hysteresis=2)
    restored.load_state_dict(s.state_dict())
    assert (restored.scale, restored.growth_tracker, restored.hysteresis_tracker) == (2.0 ** 15, 0, 2)


def test_config_from_args_and_validation():
    parser = argparse.ArgumentParser()
    add_optimizer_args(parser)
    args = parser.parse_args(["--lr", "3e-4", "--clip-grad", "0.5", "--loss-scale-window", "10"])
    args.fp16, args.bf16 = True, False  # the lead's precision group adds these flags
    cfg = optimizer_config_from_args(args)
    assert (cfg.lr, cfg.clip_grad, cfg.loss_scale_window, cfg.fp16, cfg.loss_scale) == (3e-4, 0.5, 10, True, None)
    assert cfg.initial_loss_scale == 2.0 ** 32 and cfg.hysteresis == 2 and cfg.weight_decay == 0.01
    with pytest.raises(ValueError, match="--lr is required"):
        optimizer_config_from_args(parser.parse_args([]))
    with pytest.raises(ValueError, match="mutually exclusive"):
        OptimizerConfig(lr=1e-3, fp16=True, bf16=True)


# ----- fp32 -----

def _reference_adamw(model, lr=1e-2, wd=0.1, betas=(0.9, 0.95)):
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": wd},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=True)


def test_fp32_optimizer_matches_torch_adamw_exactly():
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, None)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95, clip_grad=0.0),
                                 [ddp], None, None)
    ref_opt = _reference_adamw(ref)
    assert isinstance(opt, FP32Optimizer)
    assert [id(p) for g in opt.param_groups for p in g["params"]] == \
        [id(p) for p in model.parameters() if p.ndim >= 2] + [id(p) for p in model.parameters() if p.ndim < 2]
    for step in range(4):
        x, y = _batch(step)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        ok, norm, zeros = opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        ref_opt.step()
        assert ok and zeros is None and norm == pytest.approx(float(ref_norm), rel=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    assert max((p - q).abs().max() for p, q in zip(model.parameters(), _mlp().parameters())) > 1e-3  # it trained


def test_fp32_clipping_matches_clip_grad_norm():
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95, clip_grad=0.05),
                                 [model], None, None)
    ref_opt = _reference_adamw(ref)
    x, y = _batch(0)
    (100 * F.mse_loss(model(x), y)).backward()
    (100 * F.mse_loss(ref(x), y)).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    ok, norm, _ = opt.step()
    ref_opt.step()
    assert ok and ref_norm > 1.0 and norm == pytest.approx(ref_norm, rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # plain module (no DDP): grads are dropped


def test_grad_norm_is_exact_for_gradients_of_real_size():
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3 for n in (16_777_217, 3, 4096)]
    expected = sum(g.double().square().sum().item() for g in grads) ** 0.5
    assert get_grad_norm_fp32(grads, None) == pytest.approx(expected, rel=1e-7)  # fp32 norms: ~5e-4 off


def test_shared_params_are_left_out_of_the_norm_but_clipped():
    model = _mlp()
    model[3].weight.shared = True  # e.g. the last stage's copy of a tied embedding
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1e-3), [model], None, None)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    others = [p.grad.clone() for p in model.parameters() if p is not model[3].weight]
    expected = torch.cat([g.flatten() for g in others]).norm().item()
    shared_grad = model[3].weight.grad.clone()
    _, norm, _ = opt.step()
    assert norm == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(model[3].weight.grad, shared_grad * (1e-3 / (expected + 1e-6)))


def test_non_finite_grad_norm_skips_fp32_update():
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model], None, None)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    model[0].bias.grad[0] = float("nan")
    ok, norm, _ = opt.step()
    assert not ok and norm != norm
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ----- tensor parallel norm -----

def _full_init(seed):
    def init(w):
        nn.init.normal_(w, std=0.3, generator=torch.Generator().manual_seed(seed))
    return init


def _tp_norm_worker(rank, world_size):
    ps.initialize_model_parallel(2, 1)
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 16, init_method=_full_init(1))
    row = RowParallelLinear(16, 8, init_method=_full_init(2))
    norm = nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.add_(torch.linspace(-0.5, 0.5, 8))
        col.bias.add_(0.1 * torch.arange(col.bias.numel()) + rank)  # distinct per shard: exercises the bias grad
        row.bias.add_(0.2)
    model = nn.ModuleList([col, row, norm])
    full = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)])
    with torch.no_grad():
        for full_lin, init in [(full[0], _full_init(1)), (full[1], _full_init(2))]:
            init(full_lin.weight)
        full[0].bias.copy_(torch.cat([0.1 * torch.arange(8) + r for r in range(2)]))
        full[1].bias.fill_(0.2)
        full[2].weight.copy_(norm.weight)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    target = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    ddp = DistributedDataParallel(model, ps.get_data_parallel_group())
    cfg = OptimizerConfig(lr=1e-2, clip_grad=0.01)
    opt = get_megatron_optimizer(cfg, [ddp], ps.get_data_parallel_group(), ps.get_model_parallel_group())
    F.mse_loss(norm(row(F.gelu(col(x)))), target).backward()
    ddp.finish_grad_sync()
    ok, tp_norm, _ = opt.step()

    full_opt = _reference_adamw(full, lr=1e-2, wd=0.01, betas=(0.9, 0.999))
    F.mse_loss(full[2](full[1](F.gelu(full[0](x)))), target).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(full.parameters(), 0.01))
    full_opt.step()
    sl = slice(8 * rank, 8 * rank + 8)
    with torch.no_grad():
        errors = [(col.weight - full[0].weight[sl]).abs().max(), (col.bias - full[0].bias[sl]).abs().max(),
                  (row.weight - full[1].weight[:, sl]).abs().max(), (row.bias - full[1].bias).abs().max(),
                  (norm.weight - full[2].weight).abs().max()]
    return ok, tp_norm, ref_norm, max(float(e) for e in errors)


@pytest.mark.multiprocess
def test_grad_norm_under_tensor_parallel_equals_full_model():
    results = run_distributed(_tp_norm_worker, 2)
    for ok, tp_norm, ref_norm, max_err in results:
        assert ok and ref_norm > 0.01  # clipping is active
        assert tp_norm == pytest.approx(ref_norm, rel=1e-6)
        assert max_err < 1e-6  # the clipped TP step equals the clipped single-process step
    assert results[0][1] == results[1][1]


# ----- 16-bit -----

def test_fp16_overflow_skips_step_lowers_scale_then_recovers():
    model = _mlp(torch.float16)
    ddp = DistributedDataParallel(model, None)
    cfg = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=2.0 ** 10, hysteresis=1, loss_scale_window=100,
                          clip_grad=0.0)
    opt = get_megatron_optimizer(cfg, [ddp], None, None)
    assert isinstance(opt, Float16OptimizerWithFloat16Params) and opt.get_loss_scale() == 1024.0
    x, y = _batch(0, torch.float16)
    before = [p.detach().clone() for p in model.parameters()]

    opt.zero_grad()
    opt.scale_loss(F.mse_loss(ddp(x).float(), y.float())).backward()
    ddp.finish_grad_sync()
    model[3].weight.main_grad[0, 0] = float("inf")
    assert opt.step() == (False, None, None)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.get_loss_scale() == 512.0

    opt.zero_grad()
    loss = F.mse_loss(ddp(x).float(), y.float())
    opt.scale_loss(loss).backward()
    ddp.finish_grad_sync()
    scaled = model[3].weight.main_grad.clone()
    ok, norm, _ = opt.step()
    assert ok and norm is not None and norm > 0
    # The optimizer saw the unscaled grads: scaled / 512 (in place, in the DDP buffer).
    torch.testing.assert_close(model[3].weight.main_grad * 512.0, scaled)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    masters = [g["params"] for g in opt.param_groups]
    assert all(m.dtype == torch.float32 for ms in masters for m in ms)
    assert opt.get_loss_scale() == 512.0


def test_bf16_loss_falls_with_fp32_masters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)
    ddp = DistributedDataParallel(model, None)
    opt = get_megatron_optimizer(OptimizerConfig(lr=3e-2, bf16=True, weight_decay=0.0), [ddp], None, None)
    assert opt.get_loss_scale() == 1.0
    x, y = _batch(7, torch.bfloat16, n=32)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.mse_loss(ddp(x).float(), y.float())
        opt.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        assert all(p.grad is None for p in model.parameters())  # 16-bit grads freed into main_grad
        assert opt.step()[0]
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]
    state = next(iter(opt.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32
    for p, m in zip([p for p in model.parameters() if p.ndim >= 2], opt.param_groups[0]["params"]):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_fp16_state_dict_round_trip_resumes_identically():
    def build():
        model = _mlp(torch.float16)
        ddp = DistributedDataParallel(model, None)
        cfg = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=256.0, loss_scale_window=2)
        return model, ddp, get_megatron_optimizer(cfg, [ddp], None, None)

    def train_step(model, ddp, opt, seed):
        x, y = _batch(seed, torch.float16)
        opt.zero_grad()
        opt.scale_loss(F.mse_loss(ddp(x).float(), y.float())).backward()
        ddp.finish_grad_sync()
        return opt.step()

    model, ddp, opt = build()
    for s in range(3):
        train_step(model, ddp, opt, s)
    assert opt.get_loss_scale() == 512.0  # grew after loss_scale_window clean steps
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    model2, ddp2, opt2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    assert opt2.get_loss_scale() == 512.0 and opt2.grad_scaler.growth_tracker == opt.grad_scaler.growth_tracker
    train_step(model, ddp, opt, 10)
    train_step(model2, ddp2, opt2, 10)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_misuse_gives_clear_errors():
    with pytest.raises(ValueError, match="wrap each model chunk in"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True), [_mlp(torch.bfloat16)], None, None)
    with pytest.raises(ValueError, match="neither --fp16 nor --bf16"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3), [DistributedDataParallel(_mlp(torch.bfloat16), None)],
                               None, None)
    with pytest.raises(ValueError, match="build the model in torch.float16"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, fp16=True),
                               [DistributedDataParallel(_mlp(torch.bfloat16), None)], None, None)
