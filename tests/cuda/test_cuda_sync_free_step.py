"""The steady-state training step does not stall the host on the GPU: with host offload (pinned shards, host
and device sub-groups, the host lane, the update under the next forward, clipping on) the forward and
backward make no synchronising CUDA call, and ``engine.step`` makes exactly one: the read of the global
gradient norm and the overflow flag (one 2-element tensor), which clipping and loss scaling need on the host.

Synchronising calls are counted with ``torch.cuda.set_sync_debug_mode("warn")`` (common.SyncCounter), which
reports ``.item()``, ``.tolist()``, blocking copies (``torch.tensor(x, device=cuda)``, ``.to(cuda)`` of a host
tensor) and explicit synchronisations, on any thread; event waits are not reported by torch and not counted.
Controls show that a synchronisation is counted on the training thread, on another thread and inside a
backward hook."""
from __future__ import annotations

import math
import threading

import torch

from tests.cuda.common import CUDA, SyncCounter, device_engine, gpu_only, offload_config
from tests.zero_cache.common import batches, rank_micro_batches

pytestmark = gpu_only()
WARM_UP, MEASURED = 3, 3  # the first steps allocate pools and record the gather trace


def _read_in_hook(grad: torch.Tensor) -> None:
    """A gradient hook that reads a value on the host (it runs on the autograd engine's device thread)."""
    grad.sum().item()


def test_sync_counter_sees_every_thread_and_backward_hooks():
    x = torch.ones(4, device=CUDA, requires_grad=True)
    x.register_hook(_read_in_hook)
    mode = torch.cuda.get_sync_debug_mode()
    with SyncCounter() as syncs:
        syncs.phase = "main"
        torch.ones(1, device=CUDA).item()
        syncs.phase = "thread"
        worker = threading.Thread(target=lambda: torch.zeros(2, device=CUDA).tolist(), name="worker")
        worker.start()
        worker.join()
        syncs.phase = "backward"
        (x * 2).sum().backward()
        syncs.phase = "none"
        torch.ones(1, device=CUDA).add_(1)  # asynchronous: not counted
    assert [r[:2] for r in syncs.records if r[0] != "backward"] == [("main", "MainThread"), ("thread", "worker")]
    assert len(syncs.of("backward")) == 1
    assert torch.cuda.get_sync_debug_mode() == mode  # restored


def _step(engine, step_batch: torch.Tensor, syncs: SyncCounter, losses: list) -> None:
    syncs.phase = "forward+backward"
    for mb in rank_micro_batches(step_batch, 0, 1):
        loss = engine(mb)
        losses.append(loss.detach())  # read after the measured steps: .item() is a synchronisation
        engine.backward(loss)
    syncs.phase = "step"
    engine.step()


def test_steady_state_step_synchronises_the_host_once():
    cfg = offload_config(pinned=True, prefetch_cache_sub_group_rate=0.5, sub_group_size=600)
    cfg["gradient_clipping"] = 1e-3  # clipped every step: the update's gradient scale is not 1
    _, engine = device_engine(cfg)
    assert engine.lane is not None  # gradients land in host shards on the host lane
    assert any(engine.optimizer.on_device) and not all(engine.optimizer.on_device)  # device and host sub-groups
    data = batches(WARM_UP + MEASURED).to(CUDA)
    losses: list = []
    with SyncCounter() as syncs:
        for s in range(WARM_UP):
            _step(engine, data[s], syncs, losses)
        assert engine.update.in_flight()  # the host sub-groups' update runs under the next forward
        syncs.clear()  # from here on the steady state, the last warm-up update included
        per_step = []
        for s in range(WARM_UP, WARM_UP + MEASURED):
            _step(engine, data[s], syncs, losses)
            per_step.append(len(syncs.of("step")) - sum(per_step))
        syncs.phase = "step"
        engine.finish_update()  # the last update, still running under no forward, belongs to its step
    engine.close()
    detail = "\n".join(f"{phase} [{thread}] {where}" for phase, thread, where in syncs.records)
    assert syncs.of("forward+backward") == [], f"synchronising calls in forward/backward:\n{detail}"
    assert len(syncs.of("step")) == MEASURED, f"expected one per step (the norm read), got:\n{detail}"
    assert per_step == [1] * MEASURED, detail
    assert all(math.isfinite(v) for v in torch.stack(losses).tolist())
