"""The real-stream copy path (zero_cache/streams.py CudaStreams), skipped without a GPU: copies on the two copy
streams ordered by events, pinned double-buffered staging of pageable memory, and the engine with host
offload (pageable and pinned shards, rates 0 and 0.5 with the heterogeneous step, the speculative host
update) against the fp32 reference on the same GPU, and bf16 with the update under the next forward against
the step that waits for it."""
from __future__ import annotations

import pytest
import torch

import zero_cache
from tests.cuda.common import device_reference, make_device_model
from tests.zero_cache.common import GAS, assert_close_losses, assert_close_weights, batches, ds_config, train_engine
from zero_cache.streams import CudaStreams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)")

STEPS = 5
CUDA = torch.device("cuda", 0)
WEIGHT_TOL = 1e-4  # final weights: CPU (host sub-groups) vs CUDA (reference) Adam arithmetic


@pytest.fixture(scope="module", autouse=True)
def strict_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def reference():
    return device_reference(CUDA, STEPS)


def test_copies_run_on_their_streams_ordered_by_events():
    streams = CudaStreams(CUDA)
    streams.configure_staging(1 << 20, 1 << 20)
    compute = torch.cuda.current_stream(CUDA)
    dst = torch.empty(1 << 18, device=CUDA)
    busy = torch.randn(2048, 2048, device=CUDA)
    for _ in range(4):  # queue compute the copy must wait for: it writes a block compute still reads
        busy = busy @ busy / busy.norm()
    src = torch.arange(1 << 18, dtype=torch.float32)  # pageable: staged through the pinned pool
    copy = streams.h2d(dst, src, after=(streams.compute_event(),))
    assert copy.source_free.query()  # the staged copy no longer reads src
    src.fill_(-1.0)
    streams.wait(copy.done)  # the compute stream, not the host, waits
    torch.testing.assert_close(dst.cpu(), torch.arange(1 << 18, dtype=torch.float32))
    pinned = torch.ones(1 << 18).pin_memory()
    direct = streams.h2d(dst, pinned)
    assert direct.source_free is direct.done  # a pinned source is read by the copy itself
    streams.wait(direct.done)
    back, landed = streams.d2h_staged(dst, after=(streams.compute_event(),))
    landed.synchronize()
    assert back.is_pinned() and torch.equal(back, torch.ones(1 << 18))
    streams.release(back)
    assert compute == torch.cuda.current_stream(CUDA)  # the compute stream was never switched
    torch.cuda.synchronize()
    stats = streams.take_stats()
    assert stats.copies == 3 and stats.h2d_bytes == 2 * 4 << 18 and stats.d2h_bytes == 4 << 18
    assert stats.issued_seconds > 0


def test_staging_pool_reuses_a_buffer_only_after_its_copy():
    streams = CudaStreams(CUDA)
    streams.configure_staging(4 << 16, 0)
    outs = [torch.empty(1 << 16, device=CUDA) for _ in range(5)]
    for i, out in enumerate(outs):  # five pageable sources through two pinned buffers
        streams.wait(streams.h2d(out, torch.full((1 << 16,), float(i))).done)
    assert streams.staging_bytes == 2 * (4 << 16)
    for i, out in enumerate(outs):
        assert torch.equal(out.cpu(), torch.full((1 << 16,), float(i)))


@pytest.mark.parametrize("rate,pinned,speculative", [(0.0, False, False), (0.0, True, True), (0.5, True, False)])
def test_host_offload_on_streams_matches_fp32_reference(reference, rate, pinned, speculative):
    ref_losses, ref_weights = reference
    cfg = ds_config(3, 1, offload=True, prefetch_cache_sub_group_rate=rate, speculative_update=speculative)
    for key in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][key]["pin_memory"] = pinned
    model = make_device_model(CUDA)
    engine = zero_cache.initialize(model=model, config=cfg)
    engine.register_external_parameter(model.head, model.embed.weight)
    assert isinstance(engine.streams, CudaStreams) and engine.lane is not None
    losses = train_engine(engine, batches(STEPS).to(CUDA), 0, 1)
    torch.cuda.synchronize()
    stats = engine.copy_stats()
    host_grads = sum(c.plan.shard for c in engine.chunks if engine.reducer.to_host[c.index])
    weights = engine.gather_state_dict()
    engine.close()
    assert_close_losses(losses, ref_losses)
    assert_close_weights(weights, ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
    assert stats.d2h_bytes == 4 * GAS * host_grads and stats.h2d_bytes > 0


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_bf16_update_under_the_next_forward_equals_the_waiting_step(offload, tmp_path):
    """bf16 parameter shards on the GPU, fp32 masters and Adam states in host memory or on SSD: the update
    under the next forward (overlap_optimizer_step) copies each shard back on the copy stream while the forward
    runs, and each gather waits for its chunk's copy. Bit-identical to the step that waits for its update."""
    runs = {}
    for overlap in (False, True):
        where = {"device": offload, "nvme_path": str(tmp_path / f"overlap{overlap}")}
        cfg = ds_config(3, 1, sub_group_size=600, overlap_optimizer_step=overlap, offload_optimizer=where)
        model = make_device_model(CUDA)
        engine = zero_cache.initialize(model=model, config=cfg | {"bf16": {"enabled": True}})
        engine.register_external_parameter(model.head, model.embed.weight)
        assert all(engine.optimizer.crossing.values())  # every write-back is a copy to the GPU
        data = batches(STEPS).to(CUDA)
        losses, running = [], []
        for s in range(STEPS):
            losses += train_engine(engine, data, 0, 1, steps=[s])
            running.append(engine.optimizer.in_flight())
        weights = engine.gather_state_dict()
        engine.close()
        runs[overlap] = losses, weights, running
    assert runs[False][2] == [False] * STEPS and runs[True][2] == [True] * STEPS
    assert runs[True][0] == runs[False][0]
    for name, w in runs[False][1].items():
        assert torch.equal(runs[True][1][name], w), name
