"""The interleaved 1F1B schedule end to end: PP2 with two model chunks per stage (4 layers, one per chunk).

Training equals the single-process run within 1e-5 (losses and final weights) with DDP and with ZeRO-3 (offload),
in the steady 1F1B phase (4 micro-batches per step) and with all micro-batches in warm-up (2 = PP); checkpoints
resume across interleaving both ways; the checkpoint layout sees the chunks; DDP
reduces every bucket once per step when the chunks' last backwards come at different times.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.checkpoint.common import CONFIGS, build_trained
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import (
    LLAMA_STYLE,
    TINY_GPT,
    _train_rank,
    assert_same_training,
    check_matches_reference,
    ds_config_flags,
    reference,
    train,
)

pytestmark = pytest.mark.multiprocess

VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
MBS1 = ["--micro-batch-size", "1"]  # 8 micro-batches per step: 4 per data-parallel rank on PP2 x DP2
EVAL = ["--eval-iters", "1", "--eval-interval", "5"]  # the forward-only schedule between steps (training unchanged)


@pytest.mark.parametrize("run", ["ddp-pp2-m4", "ddp-pp2dp2-m2-tied", "zero3-pp2-m4-tied"])
def test_interleaved_matches_single_process(run, tmp_path):
    """m = micro-batches per step and data-parallel rank: 4 has a steady phase, 2 (= PP) is all warm-up. RoPE
    (LLAMA_STYLE) or GPT-2's tied word embedding (chunk 0 of stage 0 and chunk 1 of stage 1 hold its copies)."""
    extra, mesh, world = {
        "ddp-pp2-m4": (LLAMA_STYLE, VPP + EVAL, 2),
        "ddp-pp2dp2-m2-tied": ([], VPP, 4),
        "zero3-pp2-m4-tied": ([], VPP + ds_config_flags(tmp_path, 3), 2),
    }[run]
    check_matches_reference(extra, mesh, world)


def _traced_rank(rank: int, world: int, argv: list[str]) -> dict:
    """``_train_rank``, also recording at each step whether the ZeRO-3 gathers followed the last step's trace."""
    from zero_cache.coordinator import ParamCoordinator

    end_step = ParamCoordinator.end_step

    def recorded(self):
        followed.append(self.trace_ok and self.pos == len(self.trace))
        end_step(self)

    followed: list[bool] = []
    ParamCoordinator.end_step = recorded
    out = _train_rank(rank, world, argv)
    out["followed"] = followed
    return out


def test_zero3_offload_matches_single_process_and_prefetches_by_trace(tmp_path):
    """The engine records the order in which the interleaved chunks' modules gather their parameters and
    prefetches by it: from the second step on every step replays it exactly (the first step's prediction, module
    order, does not hold under interleaving)."""
    ref_losses, ref_params, _ = reference(tuple(LLAMA_STYLE + MBS1))
    losses, params, outs = train(TINY_GPT + LLAMA_STYLE + MBS1 + VPP + ds_config_flags(tmp_path, 3, offload=True), 4,
                                 rank_fn=_traced_rank)
    assert_same_training(losses, params, ref_losses, ref_params)
    for o in outs:
        assert o["followed"][1:] == [True] * 9, o["followed"]


def _resume(tmp_path, name: str, first: tuple[list[str], int], then: tuple[list[str], int]) -> None:
    """Train 5 iterations on ``first`` (flags, world) and save; resume on ``then``: the 10 iterations and the
    final weights equal the uninterrupted single-process run's."""
    ref_losses, ref_params, _ = reference(tuple(LLAMA_STYLE))
    ckpt = ["--save", str(tmp_path / name), "--load", str(tmp_path / name), "--save-interval", "5"]
    losses, _, _ = train(TINY_GPT + LLAMA_STYLE + first[0] + ckpt + ["--exit-interval", "5"], first[1])
    assert sorted(losses) == [1, 2, 3, 4, 5], name
    for it in range(1, 6):
        assert losses[it] == pytest.approx(ref_losses[it], rel=1e-5), f"{name} iteration {it}"
    losses, params, _ = train(TINY_GPT + LLAMA_STYLE + then[0] + ckpt, then[1])
    assert_same_training(losses, params, ref_losses, ref_params, iterations=range(6, 11), what=name)


def test_checkpoint_resumes_across_interleaving(tmp_path):
    """Chunk k of stage r holds other layers than stage r without interleaving: the distributed checkpoint's
    global names place them (layers 0, 2 | 1, 3 against 0, 1 | 2, 3)."""
    _resume(tmp_path, "interleaved-to-plain", (VPP, 2),
            (["--pipeline-model-parallel-size", "2"] + ds_config_flags(tmp_path, 3, offload=True), 2))
    _resume(tmp_path, "plain-to-interleaved", ([], 1), (VPP + ds_config_flags(tmp_path, 3, offload=True), 4))


def _layout_worker(rank: int, world: int, virtual_stages: int) -> dict:
    """Every tensor this rank stores in a distributed checkpoint, as (global name, offsets, global shape, values)."""
    from megatron.core import parallel_state as ps
    from megatron.training.checkpoint.layout import model_layout

    ps.initialize_model_parallel(1, world)
    out = {}
    for cfg_name, cfg in CONFIGS.items():
        model, _, _ = build_trained(cfg, virtual_stages=virtual_stages)
        places = model_layout(model)
        out[cfg_name] = [(place.name, place.offsets, place.global_shape, p.detach().clone())
                         for name, p in model.named_parameters() if (place := places[name]).writes]
    return out


def test_checkpoint_layout_of_model_chunks():
    """The layout of PP2 x v2 ranks covers the single-process model exactly, with its values."""
    whole = run_distributed(_layout_worker, 1, 1)[0]
    pieces = run_distributed(_layout_worker, 2, 2)
    for cfg_name, expected in whole.items():
        stored = [entry for rank in pieces for entry in rank[cfg_name]]
        assert sorted(e[0] for e in stored) == sorted(e[0] for e in expected), cfg_name
        by_name = {e[0]: e for e in stored}
        for name, offsets, shape, values in expected:
            got = by_name[name]
            assert got[1:3] == (offsets, shape), name
            torch.testing.assert_close(got[3], values, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")



class _TwoChunks(nn.Module):
    def __init__(self):
        super().__init__()
        self.chunks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2))


def _ddp_worker(rank: int, world: int) -> dict:
    """Backwards in the interleaved schedule's order for 2 chunks x 2 micro-batches (last chunk first), each
    chunk's last one outside no_sync; buckets of 24 elements, one straddling the chunks."""
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    model = _TwoChunks()
    plain = _TwoChunks()
    plain.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, dist.group.WORLD, bucket_size=24)
    launched, original = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        launched.append(next(i for i, b in enumerate(ddp.buckets) if b.grad_data.data_ptr() == tensor.data_ptr()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        inputs = torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(rank))  # [chunk, micro-batch]
        after_chunk = {}
        for c in (1, 0):
            for mb in range(2):
                with ddp.no_sync() if mb == 0 else contextlib.nullcontext():
                    model.chunks[c](inputs[c, mb]).square().sum().backward()
                plain.chunks[c](inputs[c, mb]).square().sum().backward()
            after_chunk[c] = list(launched)
        ddp.finish_grad_sync()
    finally:
        dist.all_reduce = original
    expected = {}
    for name, p in plain.named_parameters():
        dist.all_reduce(p.grad)
        expected[name] = p.grad / world
    return {"launched": launched, "after_chunk": after_chunk, "sizes": [b.grad_data.numel() for b in ddp.buckets],
            "grads": {n: p.main_grad.clone() for n, p in model.named_parameters()}, "expected": expected}


def test_ddp_reduces_each_bucket_once_as_chunks_finish():
    for out in run_distributed(_ddp_worker, 2):
        assert out["sizes"] == [24, 36, 20]  # [chunk 1's], [chunk 1's first weight + chunk 0's last layer], ...
        assert out["launched"] == [0, 1, 2]  # each bucket once, in order
        assert out["after_chunk"] == {1: [0], 0: [0, 1, 2]}  # chunk 1's bucket overlapped chunk 0's backwards
        for name, grad in out["grads"].items():
            torch.testing.assert_close(grad, out["expected"][name], msg=lambda m, name=name: f"{name}: {m}")
