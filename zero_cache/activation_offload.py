"""Activation offload: the tensors autograd saves in chosen layers' forwards wait for their backward in pinned host
memory instead of device memory (the idea of Megatron-core's ``--cpu-offloading`` and TransformerEngine's CPU
offload, built on this package's copy engines: stream_interface.py).

Use, in a model's layer loop (``offloader = ActivationOffloader(engine.streams)``)::

    for i, layer in enumerate(self.layers):
        with offloader.layer(i, offload=i < num_offloaded):
            x = layer(x)
        x = offloader.layer_output(i, x)

Forward. ``layer(i)`` runs the layer under ``torch.autograd.graph.saved_tensors_hooks``. A tensor autograd saves
there is moved when it is a plain tensor on the compute device of at least ``min_bytes``; parameters (and views of
them, and leaves that require grad) stay where their owner keeps them: the ZeRO engine gathers them again for the
backward. The pack hook copies it, after the compute event, on the device-to-host stream into a pinned host block
of the same size laid out as ``torch.empty_like`` would (strides kept for dense tensors, a non-dense view becomes
contiguous). The device tensor is kept referenced until that copy is done (a copy engine reads it), then dropped:
pending copies are polled at every save, at layer boundaries and in the backward, so the device memory goes back as
soon as the forward itself no longer uses it. A tensor saved twice in one layer (Q, K and V reading one
LayerNorm output) crosses once. At a step's end call ``poll()`` (or ``flush()``, which waits for the copies): a copy
that lands after the last backward is otherwise retired only at the next step's first layer.

Backward. ``layer_output(i, out)`` hooks the gradient of layer i's output: when the backward reaches it, the
host-to-device copies of layer i's tensors (where not issued yet) and of layer i-1's (depth-1 prefetch: they overlap
layer i's backward) are issued into fresh device tensors, after the compute event. Autograd's unpack hook makes the
compute stream wait for its tensor's copy (issuing the copy itself if no hook did: a "demand reload", counted) and
returns it. A tensor whose device-to-host copy has not landed yet is still held: it is handed back as it is, with no
round trip. Wrap every layer, ``offload=False`` for those kept on the device: the last offloaded layer is then
prefetched under the backward of the layer after it.

State is per layer call, owned by the autograd graph: autograd keeps each saved tensor's handle, the handles keep
their layer's record, the output's gradient hook keeps it too. So several forwards can be in flight before their
backwards (pipeline 1F1B), and a graph that is freed (after its backward, or dropped) gives its host blocks back.
Layer i-1's record is linked to layer i's only when layer i-1 was the layer call just before (one forward).
Host blocks go back to a pool by size and are reused, for the next layer or the next step, once the last copy
reading or writing them is done (its event): pinned memory is mapped and pinned once (pinned_memory.py).

Event discipline. The device-to-host copy reads a tensor compute wrote: it waits for the compute event, and the
tensor stays referenced until the copy is done, so its memory is never reused under the copy (no
``record_stream``). A reloaded tensor is allocated on the compute stream, written on the host-to-device stream
after the compute event (the block may have been in use by kernels queued before), and read only after compute
waited for the copy; one freed without being read (a graph dropped before its backward) is first handed to the
allocator with ``record_stream`` on the copy stream (on a GPU) or after ``before_free`` (the emulator).

Without an accelerator (``HostStreams``: host and device are one memory) moving activations gains nothing: the
offloader is a no-op (``enabled`` is False), its context managers install no hooks.

Limitations:
- Do not enter ``layer()`` inside an activation-checkpointed (recomputed) function: the recomputation during the
  backward would run the offload again. Recomputation inside an offloaded layer is fine (selective recompute: the
  checkpoint's own hooks are the inner ones; its saved inputs are offloaded).
- A saved tensor changed in place after it was saved is detected only until its copy lands (then the copy is the
  original); autograd's own check does not run under saved-tensor hooks.
- ``retain_graph``: a tensor reloaded for the first backward stays on the device until the graph is freed.
- Tensor subclasses (FP8 tensors, DTensor), sparse and other non-strided tensors stay on the device; a layer's
  output passed to ``layer_output`` must be one tensor; one thread runs the forwards; not CUDA-graph capturable.
"""
from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .aio import AlignedBuffer, round_up
from .stream_interface import DONE, Event, Streams
from .streams import CudaStreams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationOffloadOptions:
    # A smaller saved tensor stays on the device: a copy's fixed cost and a page of pinned memory outweigh its bytes.
    min_bytes: int = 1 << 16
    prefetch: bool = True  # reload layer i-1 when the backward reaches layer i's output (else: on demand)


@dataclass(frozen=True)
class ActivationOffloadStats:
    """Activation offload since the last ``take_stats``; the host figures are bytes of saved tensors."""
    offloaded_bytes: int = 0  # device to host
    reloaded_bytes: int = 0  # host to device
    offloaded_tensors: int = 0
    demand_reloads: int = 0  # reloads the backward issued itself (not prefetched, so not overlapped)
    host_peak_bytes: int = 0  # most saved-tensor bytes in host memory at once
    host_cached_bytes: int = 0  # pinned host memory the block pool holds (in use and free)

    def __str__(self) -> str:
        return (f"activation offload {self.offloaded_bytes / 2**20:.2f}MiB out, {self.reloaded_bytes / 2**20:.2f}MiB "
                f"back ({self.offloaded_tensors} tensors, {self.demand_reloads} not prefetched), host peak "
                f"{self.host_peak_bytes / 2**20:.2f}MiB of {self.host_cached_bytes / 2**20:.2f}MiB pinned")


class _HostBlock:
    """A pinned host mapping; ``guard``: the last copy that reads or writes it."""
    __slots__ = ("buffer", "guard")

    def __init__(self, buffer: AlignedBuffer):
        self.buffer = buffer
        self.guard: Event = DONE


class _Record:
    """One layer call of one forward: weak references to its saved tensors, and to the layer call before it."""
    __slots__ = ("index", "prev", "saved", "seen", "__weakref__")

    def __init__(self, index: int, prev: weakref.ref[_Record] | None):
        self.index = index
        self.prev = prev
        self.saved: list[weakref.ref[_Saved]] = []
        # id(tensor) -> (the tensor, weakly; its handle, weakly): a tensor saved again while it lives crosses once.
        self.seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}


class _Saved:
    """What autograd keeps instead of a saved tensor: its host copy, and the device tensor while one exists."""
    __slots__ = ("owner", "record", "shape", "stride", "dtype", "nbytes", "version", "block", "host", "landed",
                 "source", "device", "reload", "awaited", "modified", "__weakref__")

    def __init__(self, owner: ActivationOffloader, record: _Record, t: torch.Tensor, stride: tuple[int, ...],
                 block: _HostBlock, host: torch.Tensor, landed: Event):
        self.owner = owner
        self.record = record  # the layer's record lives as long as any of its saved tensors
        self.shape, self.stride, self.dtype = t.shape, stride, t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.version = t._version
        self.block, self.host, self.landed = block, host, landed
        self.source: torch.Tensor | None = t  # held until the device-to-host copy reading it is done
        self.device: torch.Tensor | None = None  # the reloaded tensor
        self.reload: Event = DONE  # its host-to-device copy
        self.awaited = False  # compute waited for that copy
        self.modified = False

    def __del__(self) -> None:
        self.owner._retire(self)


class ActivationOffloader:
    """Moves the tensors autograd saves in wrapped layers to pinned host memory and back; see the module docstring.

    ``streams``: the compute device's copy engines (``engine.streams``; for a bare device ``CudaStreams(device)``,
    ``EmulatedStreams(cfg)`` or ``make_streams``, whose owner then calls ``streams.take_stats()`` every step: CUDA
    streams keep each copy's timing events until then). Counters: ``host_bytes`` and ``device_bytes`` now,
    ``cached_bytes`` of pinned blocks, ``take_stats()`` per step."""

    def __init__(self, streams: Streams, options: ActivationOffloadOptions | None = None):
        self.streams = streams
        self.options = options or ActivationOffloadOptions()
        self.enabled = streams.separate  # HostStreams: one memory, nothing to gain
        self.device = torch.device("cpu")
        if isinstance(streams, CudaStreams):
            index = streams.device.index
            self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self._lock = threading.RLock()  # the backward may run on autograd's device thread; handles die anywhere
        self._pending: deque[_Saved] = deque()  # device-to-host copies in flight, in issue order (one stream)
        self._free: dict[int, list[_HostBlock]] = {}  # by capacity
        self._last: _Record | None = None  # the layer call that exited last
        self.host_bytes = 0  # saved-tensor bytes in host memory now
        self.device_bytes = 0  # bytes of device tensors the offloader holds (copy sources, reloaded tensors)
        self.cached_bytes = 0  # pinned memory mapped for host blocks
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._offloaded = self._reloaded = self._tensors = self._demand = 0
        self._host_peak = self.host_bytes

    # ---- the layer API ---------------------------------------------------------------------------------------
    @contextmanager
    def layer(self, index: int, offload: bool = True) -> Iterator[None]:
        """Wrap layer ``index``'s forward; with ``offload`` its saved tensors go to host memory."""
        if not self.enabled or not torch.is_grad_enabled():
            yield  # nothing is saved for a backward
            return
        self.poll()
        last = self._last
        record = _Record(index, weakref.ref(last) if last is not None and last.index == index - 1 else None)
        if offload:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, record), self._unpack):
                yield
        else:
            yield
        self._last = record
        self.poll()

    def layer_output(self, index: int, output: torch.Tensor) -> torch.Tensor:
        """Hook layer ``index``'s output (call it right after the layer's ``layer()`` block): when the backward
        reaches it, reload this layer's saved tensors and prefetch the previous layer's. Returns ``output``."""
        if not self.enabled or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return output
        record = self._last
        if record is None or record.index != index:
            raise ValueError(f"activation offload: layer_output({index}) must follow the layer({index}) block of the "
                             f"same forward (the last layer block was "
                             f"{'none' if record is None else record.index})")
        output.register_hook(lambda grad: self._reached(record))  # the graph keeps the record while it lives
        return output

    # ---- polling, stats ----------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Drop the device tensors whose device-to-host copy is done (their memory goes back)."""
        landed: list[_Saved] = []
        with self._lock:
            while self._pending and self._pending[0].landed.query():
                saved = self._pending.popleft()
                saved.landed.synchronize()  # done: returns at once, or raises the copy's error
                if saved.source._version != saved.version:
                    saved.modified = True
                saved.source = None
                self.device_bytes -= saved.nbytes
                landed.append(saved)
        del landed  # handles whose graph is gone die here, outside the lock

    def flush(self) -> None:
        """Wait (host) for every device-to-host copy in flight, then drop their sources."""
        with self._lock:
            events = [saved.landed for saved in self._pending]
        for event in events:
            self.streams.synchronize(event)
        self.poll()

    def take_stats(self) -> ActivationOffloadStats:
        with self._lock:
            stats = ActivationOffloadStats(self._offloaded, self._reloaded, self._tensors, self._demand,
                                           self._host_peak, self.cached_bytes)
            self._reset_counters()
        return stats

    def release_cached(self) -> None:
        """Unmap the free host blocks (the pool keeps them for the next step otherwise)."""
        with self._lock:
            for blocks in self._free.values():
                self.cached_bytes -= sum(b.buffer.capacity for b in blocks)
            self._free.clear()

    # ---- forward: pack -----------------------------------------------------------------------------------------
    def _movable(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor  # not a Parameter, not a subclass with its own storage rules
                and not (t.is_leaf and t.requires_grad)
                and not isinstance(t._base, nn.Parameter)  # a view of a weight (W.t() saved by a matmul)
                and t.layout == torch.strided
                # Broadcast (stride 0) views would cross, and come back, at their expanded size.
                and not any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))
                and t.device.type == self.device.type and (t.device.index or 0) == (self.device.index or 0)
                and t.numel() * t.element_size() >= max(1, self.options.min_bytes)
                and not (t.device.type == "cpu" and self.streams.pinned(t)))  # emulated: host memory already

    def _pack(self, record: _Record, t: torch.Tensor) -> object:
        if not self.enabled or not self._movable(t):
            return t
        self.poll()
        with self._lock:
            seen = record.seen.get(id(t))
            if seen is not None and seen[0]() is t:
                saved = seen[1]()
                if saved is not None and saved.version == t._version:
                    return saved
            stride = t.stride() if t.is_contiguous() else torch.empty_like(t, device="meta").stride()
            block = self._take_block(t.numel() * t.element_size())
            if block is None:
                return t
            host = block.buffer.view(t.dtype, t.numel()).as_strided(t.shape, stride)
            source = t.detach()  # the copy must not join the graph
            # Into a block the offloader owns (the interface's d2h_staged lends bounded staging buffers instead).
            landed = self.streams.d2h(host, source, (self.streams.compute_event(),))
            block.guard = landed
            saved = _Saved(self, record, source, stride, block, host, landed)
            self._pending.append(saved)
            record.saved.append(weakref.ref(saved))
            record.seen[id(t)] = (weakref.ref(t), weakref.ref(saved))
            self.device_bytes += saved.nbytes
            self.host_bytes += saved.nbytes
            self._host_peak = max(self._host_peak, self.host_bytes)
            self._offloaded += saved.nbytes
            self._tensors += 1
        return saved

    def _take_block(self, nbytes: int) -> _HostBlock | None:
        """A free pinned block of this size whose last copy is done, else a new one (None: pinning refused)."""
        size = round_up(nbytes)
        blocks = self._free.get(size, [])
        for k, block in enumerate(blocks):
            if block.guard.query():
                return blocks.pop(k)
        block = _HostBlock(AlignedBuffer(size, self.streams.pinning))
        if not self.streams.pinned(block.buffer.view(torch.uint8, 1)):
            # Copies from pageable memory would be staged through the engine's bounded pool: keep activations.
            logger.warning("zero_cache: activation offload is off, the device refused to pin host memory")
            self.enabled = False
            return None
        self.cached_bytes += block.buffer.capacity
        return block

    # ---- backward: reload, unpack ------------------------------------------------------------------------------
    def _reached(self, record: _Record) -> None:
        """The backward reached the output of ``record``'s layer."""
        self.poll()
        self._reload_layer(record, demand=False)
        prev = record.prev() if record.prev is not None and self.options.prefetch else None
        if prev is not None:
            self._reload_layer(prev, demand=False)

    def _reload_layer(self, record: _Record, demand: bool) -> None:
        for ref in record.saved:
            saved = ref()
            if saved is not None:
                self._reload(saved, demand)

    def _reload(self, saved: _Saved, demand: bool) -> None:
        with self._lock:
            if saved.source is not None or saved.device is not None:
                return  # still held (its copy out is in flight), or reloaded already
            device = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=self.device)
            transfer = self.streams.h2d(device, saved.host, after=(self.streams.compute_event(),))
            saved.device, saved.reload, saved.awaited = device, transfer.done, False
            saved.block.guard = transfer.done
            self.device_bytes += saved.nbytes
            self._reloaded += saved.nbytes
            self._demand += int(demand)

    def _unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        self.poll()
        with self._lock:
            source = packed.source
            if source is not None and source._version != packed.version:
                packed.modified = True
            if packed.modified:
                raise RuntimeError("activation offload: a tensor saved for the backward was modified in place after "
                                   "it was saved (autograd would raise here without saved-tensor hooks)")
            if source is not None:
                return source  # its copy out has not landed: no round trip
            self._reload(packed, demand=True)
            device, reload = packed.device, packed.reload
        self._await_copy(reload)
        packed.awaited = True
        return device

    def _await_copy(self, event: Event) -> None:
        """The compute stream waits for a reload before the backward reads the tensor (on a GPU, the host does not)."""
        self.streams.wait(event)

    # ---- a handle's end ------------------------------------------------------------------------------------------
    def _retire(self, saved: _Saved) -> None:
        """``saved``'s graph node released it: its host block goes back to the pool, its reloaded tensor is freed."""
        with self._lock:
            self.host_bytes -= saved.nbytes
            capacity = saved.block.buffer.capacity
            self._free.setdefault(capacity, []).append(saved.block)
            if saved.device is None:
                return
            self.device_bytes -= saved.nbytes
            if saved.awaited or saved.reload.query():
                return
            # Never read: compute did not wait for the copy writing it, so its memory must not be reused before it.
            if isinstance(self.streams, CudaStreams):
                saved.device.record_stream(self.streams.h2d_stream)
            else:
                self.streams.before_free(saved.reload)
