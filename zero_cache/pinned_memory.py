"""Pinned host memory, taken in large page-aligned pieces and pinned in place.

A copy engine reads or writes host memory asynchronously only when it is pinned (page-locked).
``Tensor.pin_memory()`` is the wrong tool for model states: it copies the tensor into a new block (a
transient second copy of every shard), and CUDA's caching host allocator rounds each block up to a power
of two (a 5 GiB shard set takes 8 GiB). Here host memory is an anonymous mapping of the size asked for
(``aio.AlignedBuffer``: page-aligned, zero-filled by the kernel, huge pages where the kernel gives them),
pinned where it lies:

- ``Pinning`` is how the compute device pins memory: ``CudaPinning`` registers it with the driver
  (``cudaHostRegister``) for as long as the mapping lives; the emulated accelerator (emulator.py) records
  it, so its copies can tell pinned from pageable sources; a CPU without either pins nothing.
- ``HostArena`` carves a store's host-tier shards from one such mapping, sized at start-up from the
  placement, so the shards take their own bytes and nothing more.

The SSD tier's staging buffers and the copy engines' staging pools are such mappings too (aio.py,
streams.py): a shard read from SSD is copied to the device straight from the buffer it was read into.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Protocol

import torch

from .aio import AlignedBuffer

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256  # every shard starts on this boundary (the widest vector loads and copy-engine bursts)


class Pinning(Protocol):
    def register(self, ptr: int, nbytes: int) -> bool:
        """Pin ``nbytes`` of host memory at ``ptr`` in place; False when the device refused (it stays pageable)."""

    def unregister(self, ptr: int) -> None:
        """Undo ``register`` of the memory at ``ptr`` (called when its mapping goes away)."""

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether a copy engine can read ``t`` directly."""


class CudaRuntime:
    """torch's bindings of the CUDA runtime (``torch.cuda.cudart()``) and the ``cudaGetLastError`` they lack,
    taken from the libcudart torch has loaded (dlopen by soname returns the copy already in the process, whose
    per-thread last error is the one torch's launch checks read)."""

    def __init__(self):
        self._bindings = torch.cuda.cudart()
        self.cudaError = self._bindings.cudaError
        self.cudaHostRegister = self._bindings.cudaHostRegister
        self.cudaHostUnregister = self._bindings.cudaHostUnregister
        self.cudaGetErrorString = self._bindings.cudaGetErrorString
        name = f"libcudart.so.{torch.version.cuda.split('.')[0]}"
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:  # a torch build with the runtime linked in statically: nothing to call
            why = str(e)
            self.cudaGetLastError = lambda: logger.warning(
                "zero_cache: %s not loadable (%s): a refused cudaHostRegister stays the runtime's last error, "
                "which the next kernel launch check reports", name, why)
            return
        lib.cudaGetLastError.restype = ctypes.c_int
        self.cudaGetLastError = lib.cudaGetLastError


class CudaPinning:
    """``cudaHostRegister`` on memory the engine mapped itself; ``is_pinned`` also knows torch's own pinned
    blocks (``Tensor.pin_memory``, a DataLoader's ``pin_memory``). ``cudart``: the runtime (CudaRuntime when
    omitted, made at the first registration)."""

    def __init__(self, cudart: Any = None):
        self._cudart = cudart
        self._registered: set[int] = set()  # storage data pointers (each mapping's start)
        self._lock = threading.Lock()
        self._warned = False

    def register(self, ptr: int, nbytes: int) -> bool:
        if self._cudart is None:
            self._cudart = CudaRuntime()
        cudart = self._cudart
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if err != cudart.cudaError.success:
            # A failed call also sets the runtime's last error, which torch's next kernel-launch check would
            # raise as that kernel's own failure; the failure is handled here (the memory stays pageable).
            cudart.cudaGetLastError()
            if not self._warned:
                self._warned = True
                logger.warning("zero_cache: could not pin %d bytes of host memory (%s); copies from it are staged "
                               "through the pinned staging buffers instead", nbytes, cudart.cudaGetErrorString(err))
            return False
        with self._lock:
            self._registered.add(ptr)
        return True

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self._registered.discard(ptr)
        self._cudart.cudaHostUnregister(ptr)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._registered or t.is_pinned()


class HostArena:
    """Host-tier shards carved from pinned mappings: one of ``reserve`` bytes made at start-up (the placement's
    host bytes), and a mapping of its own for a shard that does not fit in what is left."""

    def __init__(self, pinning: Pinning, reserve: int = 0):
        self.pinning = pinning
        self._buffers: list[AlignedBuffer] = []
        self._current: AlignedBuffer | None = None
        self._offset = 0
        if reserve > 0:
            self._current = self._map(reserve)

    def _map(self, nbytes: int) -> AlignedBuffer:
        buf = AlignedBuffer(nbytes, pinning=self.pinning)
        self._buffers.append(buf)
        return buf

    @staticmethod
    def reserve_for(shard_bytes: list[int]) -> int:
        """Bytes a reserve needs to hold shards of these sizes (each aligned)."""
        return sum(-(-n // ALIGN_BYTES) * ALIGN_BYTES for n in shard_bytes)

    @property
    def held(self) -> int:
        return sum(b.capacity for b in self._buffers)

    def carve(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled flat tensor of ``numel`` elements in pinned memory."""
        nbytes = numel * dtype.itemsize
        buf = self._current
        if buf is None or self._offset + nbytes > buf.capacity:
            return self._map(nbytes).view(dtype, numel)
        start = self._offset
        self._offset = -(-(start + nbytes) // ALIGN_BYTES) * ALIGN_BYTES
        return buf.view(torch.uint8, buf.capacity)[start:start + nbytes].view(dtype)
