"""The three-tier store: compute device, host memory and SSD page files under ``nvme_path``.

Device and host shards are ordinary tensors (``DeviceHostStore``). An SSD shard has no resident tensor:
it is one page file (``aio.PageFile``) under ``<nvme_path>/zero_cache_swap/<host>_pid<pid>_r<rank>/``,
preallocated at ``allocate`` so that a disk too small fails at start-up, not mid-training. The optimizer
``swap_in``s a sub-group's shards into aligned host staging buffers (from a reused ``BufferPool``), updates
them and ``swap_out``s them; the buffers go back to the pool once written, so host memory used by the SSD
tier is the staging buffers of the sub-groups in flight (accounted, ``memory_report().swap_buffers_*``).
Checkpoints read and write element ranges of a shard (``read_range`` / ``write_range``) through one
``aio.block_size`` buffer of ``transfer_pool``, so saving or loading never holds a whole SSD shard.

The swap directory is removed by ``close()`` (also run at interpreter exit), and directories left by dead
processes of this host are removed when the next store starts.
"""
from __future__ import annotations

import os
import shutil
import socket
import weakref

import torch

from .aio import ALIGN, AioEngine, AlignedBuffer, BufferPool, PageFile, SSDTierError, spans
from .config import AioConfig
from .store import HOST, KINDS, NVME, DeviceHostStore, SwapHandle, check_range

SWAP_DIR = "zero_cache_swap"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_swap_dir(nvme_path: str, rank: int) -> str:
    """Create this process's swap directory (clear errors for a bad path); remove stale ones of this host."""
    if not nvme_path:
        raise SSDTierError("SSD tier: 'nvme_path' is empty; set offload_optimizer.nvme_path to a directory on a "
                           "local SSD")
    root = os.path.join(nvme_path, SWAP_DIR)
    host = socket.gethostname()
    try:
        os.makedirs(root, exist_ok=True)
        mine = os.path.join(root, f"{host}_pid{os.getpid()}_r{rank}")
        os.makedirs(mine, exist_ok=True)
        probe = os.path.join(mine, ".probe")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise SSDTierError(f"SSD tier: nvme_path '{nvme_path}' is not a writable directory ({e.strerror}: "
                           f"'{e.filename}'); point offload_optimizer/offload_param.nvme_path at a writable "
                           f"directory on a local SSD") from None
    for name in os.listdir(root):  # leftovers of crashed runs on this host
        prefix = f"{host}_pid"
        if name.startswith(prefix):
            pid = name[len(prefix):].split("_r")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return mine


def _cleanup(directory: str, pages: dict, aio: AioEngine) -> None:
    aio.shutdown()
    for p in pages.values():
        p.close()
    shutil.rmtree(directory, ignore_errors=True)


class SSDStore(DeviceHostStore):
    """Device + host tensors and SSD page files behind one ``ShardStore`` interface."""

    def __init__(self, device: torch.device, nvme_path: str, aio: AioConfig, rank: int = 0, pin_host: bool = False,
                 direct_io: bool = True, budgets: dict[str, int] | None = None, staging_bytes: int | None = None,
                 param_staging_bytes: int | None = None, pin=None, copy_staging: int = 0):
        super().__init__(device, pin_host, budgets, pin=pin, copy_staging=copy_staging)
        self.directory = prepare_swap_dir(nvme_path, rank)
        self.aio = AioEngine(aio)
        self.pool = BufferPool(staging_bytes)  # optimizer sub-groups and gradient shards (bounded by the reserve)
        self.param_pool = BufferPool(param_staging_bytes)  # parameter shards read for gathers (bounded too)
        self.direct_io = direct_io
        self._pages: dict[str, PageFile] = {}
        self._ssd_meta: dict[str, tuple[str, torch.dtype, int]] = {}
        self._buffers: dict[int, tuple[BufferPool, AlignedBuffer]] = {}  # id(tensor) -> staging buffer
        self._finalizer = weakref.finalize(self, _cleanup, self.directory, self._pages, self.aio)

    # ---- ShardStore -------------------------------------------------------------------------------------
    def allocate(self, key, kind, tier, numel, dtype):
        if tier != NVME:
            return super().allocate(key, kind, tier, numel, dtype)
        if key in self._pages or key in self._tensors:
            raise KeyError(f"shard '{key}' is already allocated")
        if kind not in KINDS:
            raise ValueError(f"bad kind {kind!r}; kinds {KINDS}")
        self._charge(key, NVME, numel * torch.empty((), dtype=dtype).element_size())
        path = os.path.join(self.directory, key.replace("/", "_") + ".swp")
        page = PageFile(path, key, numel, dtype, self.direct_io)
        self.direct_io = page.direct  # warn once: later files skip O_DIRECT when the filesystem refused it
        self._pages[key] = page
        self._ssd_meta[key] = (kind, dtype, numel)
        self.put(key, torch.zeros(numel, dtype=dtype))
        return None

    def get(self, key):
        if key in self._pages:
            raise KeyError(f"shard '{key}' lives on the SSD tier: use swap_in/read, not get")
        return super().get(key)

    def put(self, key, value):
        if key not in self._pages:
            return super().put(key, value)
        page = self._pages[key]
        if value.numel() != page.numel:
            raise ValueError(f"shard '{key}' holds {page.numel} elements, got {value.numel()}")
        buf = self.pool.acquire(page.capacity)
        try:
            buf.view(page.dtype, page.numel).copy_(value.reshape(-1))
            self.aio.submit(True, page, buf).result()
        finally:
            self.pool.release(buf)

    def read(self, key):
        if key not in self._pages:
            return super().read(key)
        (t,) = self.swap_in([key]).wait()
        out = t.clone()
        self.release([t])
        return out

    def read_range(self, key, lo, hi, out=None):
        if key not in self._pages:
            return super().read_range(key, lo, hi, out)
        page = self._pages[key]
        check_range(key, lo, hi, page.numel)
        out = torch.empty(hi - lo, dtype=page.dtype) if out is None else out
        size = page.itemsize
        buf = self.transfer_pool.acquire(self.aio.block)
        try:
            for start, stop in spans(lo * size, hi * size, buf.capacity):
                page.read_span(buf, start, stop, self.aio.block)
                base = start - start % ALIGN
                src = buf.view(page.dtype, (stop - base) // size)[(start - base) // size:]
                out[start // size - lo:stop // size - lo].copy_(src)
        finally:
            self.transfer_pool.release(buf)
        return out

    def write_range(self, key, lo, value):
        if key not in self._pages:
            return super().write_range(key, lo, value)
        page = self._pages[key]
        value = value.reshape(-1)
        check_range(key, lo, lo + value.numel(), page.numel)
        size = page.itemsize
        buf = self.transfer_pool.acquire(self.aio.block)
        try:
            for start, stop in spans(lo * size, (lo + value.numel()) * size, buf.capacity):
                page.fill_edges(buf, start, stop)
                base = start - start % ALIGN
                dst = buf.view(page.dtype, (stop - base) // size)[(start - base) // size:]
                dst.copy_(value[start // size - lo:stop // size - lo])
                page.write_span(buf, start, stop, self.aio.block)
        finally:
            self.transfer_pool.release(buf)

    def tier_of(self, key):
        return NVME if key in self._pages else super().tier_of(key)

    def nbytes(self):
        out = super().nbytes()
        for kind, dtype, numel in self._ssd_meta.values():
            k = (kind, NVME)
            out[k] = out.get(k, 0) + numel * torch.empty((), dtype=dtype).element_size()
        return out

    # ---- swapping ---------------------------------------------------------------------------------------
    def swap_in(self, keys, for_gather: bool = False, optional: bool = False):
        pool = self.param_pool if for_gather else self.pool
        if optional and not pool.fits(sum(self._pages[k].capacity for k in keys)):
            return None
        tensors, futures = [], []
        for key in keys:
            page = self._pages[key]
            buf = pool.acquire(page.capacity)
            t = buf.view(page.dtype, page.numel)
            self._buffers[id(t)] = (pool, buf)
            tensors.append(t)
            futures.append(self.aio.submit(False, page, buf, account=not for_gather))
        return SwapHandle(futures, tensors, on_error=lambda: self.release(tensors))

    def staging(self, keys):
        """Staging buffers for SSD-tier ``keys`` without reading them (their contents are about to be
        overwritten); ``swap_out`` writes them."""
        tensors = []
        for key in keys:
            page = self._pages[key]
            buf = self.pool.acquire(page.capacity)
            t = buf.view(page.dtype, page.numel)
            self._buffers[id(t)] = (self.pool, buf)
            tensors.append(t)
        return tensors

    def swap_out(self, keys, tensors):
        futures = []
        for key, t in zip(keys, tensors):
            futures.append(self.aio.submit(True, self._pages[key], self._buffers[id(t)][1]))
        return SwapHandle(futures, None, on_wait=lambda _h, ts=list(tensors): self.release(ts))

    def release(self, tensors: list[torch.Tensor]) -> None:
        """Return swapped-in tensors' staging buffers to the pool (without writing them)."""
        for t in tensors:
            pool, buf = self._buffers.pop(id(t))
            pool.release(buf)

    def reserved(self, tier):
        ssd = (self.pool.limit or 0) + (self.param_pool.limit or 0) if tier == HOST else 0
        return ssd + super().reserved(tier)

    def close(self) -> None:
        self._finalizer()


__all__ = ["SSDStore", "SSDTierError", "prepare_swap_dir"]
