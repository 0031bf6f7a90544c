"""The real-stream copy path (zero_cache/streams.py CudaStreams), skipped without a GPU: copies on the two copy
streams ordered by events (each ordering shown against a compute stream kept busy, with a control that
overtakes it without the event), bounded pinned staging of pageable memory that hands a buffer out again only
after its copy, and the engine with host offload (pageable and pinned shards, rates 0 and 0.5 with the
heterogeneous step, the speculative host update) against the fp32 reference on the same GPU with exact
per-step copy bytes, and bf16 with the update under the next forward against the step that waits for it."""
from __future__ import annotations

import pytest
import torch

import zero_cache
from tests.cuda.common import CUDA, STEPS, WEIGHT_TOL, busy, gpu_only, make_device_model
from tests.zero_cache.common import (
    GAS,
    assert_close_losses,
    assert_close_weights,
    batches,
    ds_config,
    rank_micro_batches,
    train_engine,
)
from zero_cache.streams import CudaStreams

pytestmark = gpu_only()
MIB = 1 << 20
BUSY = 0.3  # seconds a kernel holds the compute stream: far longer than the host needs to queue what follows


def _make_staging_buffers(pool, count: int) -> None:
    """Make ``count`` buffers of a staging pool now. Pinning host memory may wait for the GPU's queued work
    (CUDA's implicit synchronisation), which would let a busy kernel finish before the copy under test is
    issued, so every buffer a test needs exists before its compute stream is held."""
    lent = [pool.acquire(pool.unit // 4, torch.float32) for _ in range(count)]
    for buf in lent:
        pool.release(buf)


def test_copies_run_on_their_streams_ordered_by_events():
    streams = CudaStreams(CUDA)
    streams.configure_staging(MIB, MIB)
    _make_staging_buffers(streams.h2d_pool, 1)
    _make_staging_buffers(streams.d2h_pool, 1)
    compute = torch.cuda.current_stream(CUDA)
    n = MIB // 4
    old, new, twos = torch.zeros(n), torch.arange(n, dtype=torch.float32), torch.full((n,), 2.0).pin_memory()
    dst = old.to(CUDA)
    before = torch.empty_like(dst)  # allocated now: nothing below allocates while the compute stream is held
    src = new.clone()  # pageable: staged through the pinned pool

    # Host to device after the compute stream's point: compute still has to read dst (a copy queued behind a
    # busy kernel), and the copy into dst waits for that read.
    busy(BUSY)
    before.copy_(dst)
    copy = streams.h2d(dst, src, after=(streams.compute_event(),))
    assert copy.source_free.query()  # the staged copy no longer reads src
    src.fill_(-1.0)
    streams.wait(copy.done)  # the compute stream, not the host, waits
    assert torch.equal(before.cpu(), old) and torch.equal(dst.cpu(), new)

    # Control: the same situation without the event; the copy stream overtakes the busy compute stream.
    busy(BUSY)
    before.copy_(dst)
    direct = streams.h2d(dst, twos)
    assert direct.source_free is direct.done  # a pinned source is read by the copy itself
    streams.wait(direct.done)
    assert torch.equal(before.cpu(), twos.cpu())

    # Device to host after the compute stream's point: it reads what compute wrote behind a busy kernel.
    busy(BUSY)
    dst.fill_(7.0)
    back, landed = streams.d2h_staged(dst, after=(streams.compute_event(),))
    landed.synchronize()
    assert back.is_pinned() and torch.equal(back, torch.full((n,), 7.0))
    streams.release(back)
    assert compute == torch.cuda.current_stream(CUDA)  # the compute stream was never switched
    torch.cuda.synchronize()
    stats = streams.take_stats()  # every copy is done, so every one is counted
    assert (stats.copies, stats.h2d_bytes, stats.d2h_bytes) == (3, 2 * MIB, MIB)
    assert stats.issued_seconds > 0


def test_staging_pool_reuses_a_buffer_only_after_its_copy():
    """Pageable sources go through two pinned buffers. Every copy waits for a busy compute stream, so none is
    done while the next is issued: the third source must wait for the first copy instead of refilling the
    buffer that copy has yet to read."""
    unit = 256 << 10
    n = unit // 4
    streams = CudaStreams(CUDA)
    streams.configure_staging(unit, 0)
    outs = [torch.empty(n, device=CUDA) for _ in range(5)]
    _make_staging_buffers(streams.h2d_pool, 2)
    assert streams.staging_bytes == 2 * unit
    busy(BUSY)
    gate = streams.compute_event()
    copies = [streams.h2d(outs[i], torch.full((n,), float(i)), after=(gate,)) for i in range(2)]
    assert not copies[0].done.query() and not copies[1].done.query()  # both buffers lent to waiting copies
    assert streams.staging_bytes == 2 * unit
    copies.append(streams.h2d(outs[2], torch.full((n,), 2.0), after=(gate,)))
    assert copies[0].done.query()  # the third waited for the first copy's buffer
    copies += [streams.h2d(outs[i], torch.full((n,), float(i)), after=(gate,)) for i in range(3, 5)]
    assert streams.staging_bytes == 2 * unit  # bounded: no third buffer
    for c in copies:
        streams.wait(c.done)
    for i, out in enumerate(outs):
        assert torch.equal(out.cpu(), torch.full((n,), float(i))), i  # no buffer refilled under its copy


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
    data = batches(STEPS).to(CUDA)
    losses, copies = [], []
    for s in range(STEPS):
        micro = []
        for mb in rank_micro_batches(data[s], 0, 1):
            loss = engine(mb)
            micro.append(loss.item())
            engine.backward(loss)
        engine.step()
        losses.append(sum(micro) / len(micro))
        copies.append(engine.copy_stats())
    host_grads = sum(c.plan.shard for c in engine.chunks if engine.reducer.to_host[c.index])
    held = sum(engine.chunks[c].plan.shard for c in engine.reducer.keep if engine.reducer.to_host[c])
    weights = engine.gather_state_dict()
    engine.close()
    assert_close_losses(losses, ref_losses)
    assert_close_weights(weights, ref_weights, atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
    assert host_grads > 0
    for step, stats in enumerate(copies, 1):
        # Each host gradient shard's fp32 reduce-scatter result leaves the GPU once per micro-batch, a held
        # chunk's once per step (grad_reducer.py). The step drains the host lane, which waits for each of these
        # copies, before it takes the report, so every one of them is counted in its own step.
        assert stats.d2h_bytes == 4 * (GAS * host_grads - (GAS - 1) * held), step
        assert stats.h2d_bytes > 0, step  # parameter shards gathered from host memory


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
            running.append(engine.update.in_flight())
        weights = engine.gather_state_dict()
        engine.close()
        runs[overlap] = losses, weights, running
    assert runs[False][2] == [False] * STEPS and runs[True][2] == [True] * STEPS
    assert runs[True][0] == runs[False][0]
    assert runs[False][0][-1] < runs[False][0][0]  # it trained
    for name, w in runs[False][1].items():
        assert torch.equal(runs[True][1][name], w), name
