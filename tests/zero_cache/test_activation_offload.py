"""Activation offload (zero_cache/activation_offload.py) on the emulated accelerator: copies on worker threads at a
low bandwidth, destinations NaN while in flight, so a missing wait gives wrong numbers.

A stack of small blocks (Linear, GELU, a gate reading the same input, a transposed view, LayerNorm) runs two
micro-batches whose forwards both precede their backwards, with layers 0..N-2 offloaded, and must match the run
without offload bit for bit (outputs and every parameter's gradient); removing the unpack's wait for its copy
breaks it. Device memory is released once the copies out land (weak references to saved activations die), host
blocks return to the pool after the backward and are reused by the next step; strides survive the round trip;
with HostStreams, under no_grad, nothing is moved."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_cache.activation_offload import ActivationOffloader, ActivationOffloadOptions, ActivationOffloadStats
from zero_cache.config import EmulatedAcceleratorConfig
from zero_cache.emulator import EmulatedStreams
from zero_cache.streams import HostStreams

WIDTH, BATCH, BLOCKS = 32, 8, 4  # saved activations of 1 KiB
# Host to device: 1 KiB in ~10 ms, so a reload is still in flight when a backward that skips its wait reads it.
EMULATOR = EmulatedAcceleratorConfig(enabled=True, h2d_gbps=1e-4, d2h_gbps=1e-3, random_delay_ms=1.0)
OPTIONS = ActivationOffloadOptions(min_bytes=256)  # LayerNorm's per-row statistics (32 bytes) stay


class PoisonedStreams(EmulatedStreams):
    """A reload's destination reads NaN from its issue on, not only once its copy runs (fresh memory may hold the
    very values a skipped wait should have brought)."""

    def h2d(self, dst, src, after=()):
        dst.fill_(float("nan"))
        return super().h2d(dst, src, after)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.probes: list[weakref.ref] = []  # fc's output: saved by GELU only

    def forward(self, x):
        h = self.fc(x)  # saves x
        self.probes.append(weakref.ref(h))
        g = self.gate(x)  # saves x again
        y = F.gelu(h) * torch.sin(g.t()).t()  # sin saves a transposed view, mul two operands
        return self.norm(y)


def make_model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(BLOCKS))


def forward(model: nn.ModuleList, x: torch.Tensor, offloader: ActivationOffloader | None) -> torch.Tensor:
    for i, block in enumerate(model):
        if offloader is None:
            x = block(x)
            continue
        with offloader.layer(i, offload=i < BLOCKS - 1):  # the last layer stays: it prefetches the one before
            x = block(x)
        x = offloader.layer_output(i, x)
    return x


def step(model: nn.ModuleList, offloader: ActivationOffloader | None, flush: bool) -> list[torch.Tensor]:
    """Two micro-batches as 1F1B keeps them: both forwards, then both backwards."""
    torch.manual_seed(1)
    inputs = [torch.randn(BATCH, WIDTH) for _ in range(2)]
    outputs = [forward(model, x, offloader) for x in inputs]
    if offloader is not None and flush:
        offloader.flush()  # every copy out landed: the backward reloads all of them
    for out in outputs:
        out.square().mean().backward()
    return [out.detach() for out in outputs]


def assert_identical(model, reference, outputs, expected) -> None:
    for out, ref in zip(outputs, expected):
        assert torch.equal(out, ref)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.fixture
def streams():
    s = EmulatedStreams(EMULATOR)
    yield s
    s.close()


@pytest.fixture
def poisoned():
    s = PoisonedStreams(EMULATOR)
    yield s
    s.close()


@pytest.mark.parametrize("flush", [True, False], ids=["landed", "in-flight"])
def test_offloaded_run_is_bit_identical(poisoned, flush):
    reference, model = make_model(), make_model()
    expected = step(reference, None, flush)
    offloader = ActivationOffloader(poisoned, OPTIONS)
    outputs = step(model, offloader, flush)
    assert_identical(model, reference, outputs, expected)
    stats = offloader.take_stats()
    # Per block and micro-batch: x (once for fc and gate), GELU's input, sin's view, mul's two operands, norm's.
    assert stats.offloaded_tensors == 2 * (BLOCKS - 1) * 6
    if flush:  # all came back through the copy engine, prefetched (the hook of the layer after)
        assert stats.reloaded_bytes == stats.offloaded_bytes > 0 and stats.demand_reloads == 0
    offloader.flush()  # in flight: copies out still running when their tensors' backward came are retired as they land
    assert offloader.host_bytes == 0 and offloader.device_bytes == 0  # nothing left after the backwards


def test_removing_the_wait_for_a_reload_gives_wrong_gradients(poisoned, monkeypatch):
    reference, model = make_model(), make_model()
    expected = step(reference, None, True)
    monkeypatch.setattr(ActivationOffloader, "_await_copy", lambda self, event: None)
    outputs = step(model, ActivationOffloader(poisoned, OPTIONS), True)
    with pytest.raises(AssertionError):
        assert_identical(model, reference, outputs, expected)
    assert any(torch.isnan(p.grad).any() for p in model.parameters())


def test_device_memory_is_released_and_host_blocks_are_reused(streams):
    model = make_model()
    offloader = ActivationOffloader(streams, OPTIONS)
    torch.manual_seed(1)
    outs = [forward(model, torch.randn(BATCH, WIDTH), offloader) for _ in range(2)]
    offloader.flush()
    kept = [b.probes[-2:] for b in model]
    assert all(r() is None for b in kept[:-1] for r in b)  # offloaded: the device copies are gone
    assert all(r() is not None for r in kept[-1])  # the last layer's stay (the probe does see live tensors)
    assert offloader.device_bytes == 0 and offloader.host_bytes == 2 * (BLOCKS - 1) * 6 * BATCH * WIDTH * 4
    for out in outs:
        out.sum().backward()
    first = offloader.take_stats()
    assert offloader.host_bytes == 0 and offloader.device_bytes == 0
    assert first.host_peak_bytes == 2 * (BLOCKS - 1) * 6 * BATCH * WIDTH * 4

    model.zero_grad()
    step(model, offloader, True)
    second = offloader.take_stats()
    assert second.host_cached_bytes == first.host_cached_bytes > 0  # the pool's blocks were reused, none added
    assert offloader.host_bytes == 0 and offloader.device_bytes == 0
    offloader.release_cached()
    assert offloader.cached_bytes == 0


def test_without_offload_the_probe_stays_alive():
    model = make_model()
    out = forward(model, torch.randn(BATCH, WIDTH), None)
    assert all(b.probes[-1]() is not None for b in model)
    out.sum().backward()


def test_strides_survive_the_round_trip(streams):
    offloader = ActivationOffloader(streams, OPTIONS)
    x = torch.randn(16, 32, requires_grad=True)
    with offloader.layer(0):
        h = x * 2
        transposed = torch.sin(h.t())  # a dense view: its strides are kept
        sliced = torch.sin(h[:, ::2])  # not dense: comes back contiguous
        broadcast = torch.sin(h[:1].expand(16, 32))  # stride 0: stays on the device
    assert offloader.take_stats().offloaded_tensors == 2
    offloader.flush()
    back = transposed.grad_fn._saved_self  # unpacks: a reload through the copy engine
    assert back.stride() == h.t().stride() and torch.equal(back, h.t())
    back = sliced.grad_fn._saved_self
    assert back.is_contiguous() and torch.equal(back, h[:, ::2])
    assert torch.equal(broadcast.grad_fn._saved_self, h[:1].expand(16, 32))


def test_no_grad_and_host_streams_move_nothing(streams):
    model = make_model()
    offloader = ActivationOffloader(streams, OPTIONS)
    with torch.no_grad():
        out = forward(model, torch.randn(BATCH, WIDTH), offloader)
    assert not out.requires_grad and offloader.take_stats().offloaded_tensors == 0

    host = ActivationOffloader(HostStreams(), OPTIONS)
    assert not host.enabled  # one memory: nothing to gain, no hooks
    out = forward(model, torch.randn(BATCH, WIDTH), host)
    assert all(b.probes[-1]() is not None for b in model)  # activations stayed where they were
    out.sum().backward()
    model.zero_grad()
    reference = make_model()
    expected = step(reference, None, False)
    outputs = step(model, host, False)
    assert_identical(model, reference, outputs, expected)
    assert host.take_stats() == ActivationOffloadStats()
