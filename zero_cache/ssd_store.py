"""The three-tier store: compute device, host memory and SSD page files under ``nvme_path``.

Device and host shards are ordinary tensors (``DeviceHostStore``). An SSD shard has no resident tensor:
it is one page file (``aio.PageFile``) under ``<nvme_path>/zero_cache_swap/<host>_pid<pid>_r<rank>/``,
preallocated at ``allocate`` so that a disk too small fails at start-up, not mid-training. The optimizer
``swap_in``s a sub-group's shards into aligned host staging buffers (from a reused ``BufferPool``), updates
them and ``swap_out``s them; the buffers go back to the pool once written, so host memory used by the SSD
tier is the staging buffers of the sub-groups in flight (accounted, ``memory_report().swap_buffers_*``).

A write may still be in flight when ``swap_out`` returns, and nobody has to wait for it: the store keeps
each page file's I/O in order (any later read, write or range access of that shard first waits for its
write), and a read that needs staging room the pool does not have waits for the oldest writes, whose
buffers then come back. So the optimizer's last writes of a step drain while the next forward runs.
``synchronize_writes()`` waits for all of them.

Clean copies: a staging buffer whose contents equal its page file (written with ``swap_out(keep=...)``,
or released unchanged with ``release(clean=True)``) may stay in its pool as the shard's cached copy, and
the next ``swap_in`` of that shard is served from it without I/O. Each shard has a version, raised by every
write; a copy is cached only if no write started since it was read, and a write drops the cached one, so
a stale copy is never served. Clean copies are dropped (oldest first) whenever a read or staging buffer
needs their room, so they only use pool room nothing else needs.

Checkpoints read and write element ranges of a shard (``read_range`` / ``write_range``) through one
``aio.block_size`` buffer of ``transfer_pool``, so saving or loading never holds a whole SSD shard.

The swap directory is removed by ``close()`` (also run at interpreter exit), and directories left by dead
processes of this host are removed when the next store starts.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import weakref

import torch

from .aio import ALIGN, AioEngine, AlignedBuffer, BufferPool, PageFile, SSDTierError, spans
from .config import AioConfig
from .pinned_memory import Pinning
from .store import HOST, KINDS, NVME, DeviceHostStore, MemoryReport, SwapHandle, check_range

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
                 param_staging_bytes: int | None = None, pinning: Pinning | None = None, copy_staging: int = 0,
                 host_bytes: int = 0):
        super().__init__(device, pin_host, budgets, pinning=pinning, copy_staging=copy_staging, host_bytes=host_bytes)
        self.directory = prepare_swap_dir(nvme_path, rank)
        self.aio = AioEngine(aio)
        # Staging buffers are pinned wherever a device copies from them: a shard read from SSD goes to the device
        # straight from the buffer it was read into.
        self.pool = BufferPool(staging_bytes, self.pinning)  # optimizer sub-groups and gradient shards (bounded)
        self.param_pool = BufferPool(param_staging_bytes, self.pinning)  # parameter shards read for gathers
        self.direct_io = direct_io
        self._pages: dict[str, PageFile] = {}
        self._ssd_meta: dict[str, tuple[str, torch.dtype, int]] = {}
        self._buffers: dict[int, tuple[BufferPool, AlignedBuffer]] = {}  # id(tensor) -> staging buffer
        self._writing: dict[str, SwapHandle] = {}  # key -> its write from swap_out that nobody has waited for
        self._version: dict[str, int] = {}  # key -> writes started to its page file
        self._holds: dict[int, tuple[str, int]] = {}  # id(tensor) -> (key, version) of the contents it holds
        self._clean: dict[str, torch.Tensor] = {}  # key -> tensor equal to its page file (a cache, oldest first)
        self._lock = threading.Lock()  # the dicts above and _buffers: the I/O, host-lane and main threads share them
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
        self._settle([key])
        self._invalidate(key)
        self._make_room(self.pool, page.capacity, block=True)
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
        self._settle([key])
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
        self._settle([key])
        self._invalidate(key)
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
    def swap_in(self, keys, for_gather: bool = False, optional: bool = False, params: bool = False):
        pool = self.param_pool if for_gather or params else self.pool
        waited = self._settle(keys)
        with self._lock:  # clean copies are served where they are (parameter shards: the parameter pool)
            cached = {k: self._clean.pop(k) for k in keys if k in self._clean}
        need = sum(self._pages[k].capacity for k in keys if k not in cached)
        waited += self._make_room(pool, need, block=not optional)  # a read-ahead does not wait for writes
        if optional and not pool.fits(need):
            self.release(list(cached.values()), clean=True)
            return None
        tensors, futures = [], []
        for key in keys:
            if key in cached:
                tensors.append(cached[key])
                continue
            page = self._pages[key]
            buf = pool.acquire(page.capacity)
            t = buf.view(page.dtype, page.numel)
            with self._lock:
                self._buffers[id(t)] = (pool, buf)
                self._holds[id(t)] = (key, self._version.get(key, 0))
            tensors.append(t)
            futures.append(self.aio.submit(False, page, buf, account=not for_gather))
        handle = SwapHandle(futures, tensors, on_error=lambda: self.release(tensors))
        handle.waited = waited
        return handle

    def staging(self, keys):
        """Staging buffers for SSD-tier ``keys`` without reading them (their contents are about to be
        overwritten); ``swap_out`` writes them."""
        self._settle(keys)
        self._make_room(self.pool, sum(self._pages[k].capacity for k in keys), block=True)
        tensors = []
        for key in keys:
            page = self._pages[key]
            buf = self.pool.acquire(page.capacity)
            t = buf.view(page.dtype, page.numel)
            with self._lock:
                self._buffers[id(t)] = (self.pool, buf)
            tensors.append(t)
        return tensors

    def swap_out(self, keys, tensors, keep=()):
        """``keep``: parameter shards whose tensor, once written, stays cached as the shard's clean copy in
        the parameter pool, if that pool has room (the next ``swap_in`` of the key is served from it)."""
        for key in keys:
            self._invalidate(key)
        kept = [t for k, t in zip(keys, tensors) if k in keep]
        rest = [t for k, t in zip(keys, tensors) if k not in keep]

        def written(failed: bool) -> None:
            for t in kept:
                pool, buf = self._buffers[id(t)]
                moved = pool is self.param_pool or pool.give(buf, self.param_pool)
                if moved:
                    with self._lock:
                        self._buffers[id(t)] = (self.param_pool, buf)
                self.release([t], clean=moved and not failed)
            self.release(rest)

        with self._lock:  # submitted and registered at once: a read on another thread sees the write or none
            for key, t in zip(keys, tensors):
                self._holds[id(t)] = (key, self._version[key])  # what it holds once written
            futures = [self.aio.submit(True, self._pages[k], self._buffers[id(t)][1]) for k, t in zip(keys, tensors)]
            handle = SwapHandle(futures, None, on_wait=written)
            for key in keys:
                self._writing[key] = handle
        return handle

    def release(self, tensors: list[torch.Tensor], clean: bool = False) -> None:
        """Return swapped-in tensors' staging buffers to their pool. ``clean``: the tensors were not changed,
        so each may stay cached as its shard's clean copy (if no write to the shard started since its read)."""
        freed = []
        with self._lock:
            for t in tensors:
                key, version = self._holds.pop(id(t), (None, -1))
                if clean and key is not None and version == self._version.get(key, 0) and key not in self._clean:
                    self._clean[key] = t
                    self._holds[id(t)] = (key, version)
                else:
                    freed.append(self._buffers.pop(id(t)))
        for pool, buf in freed:
            pool.release(buf)

    def held_unchanged(self, key: str) -> bool:
        with self._lock:
            if key in self._clean:
                return False
            now = (key, self._version.get(key, 0))
            return any(h == now for h in self._holds.values())

    def cached_bytes(self, pool: BufferPool | None = None) -> int:
        """Bytes of staging buffers (of ``pool``, or of both) held as clean copies of shards."""
        with self._lock:
            held = [self._buffers[id(t)] for t in self._clean.values()]
        return sum(buf.capacity for p, buf in held if pool is None or p is pool)

    def io_totals_and_reset(self) -> tuple[float, int, int]:
        return self.aio.busy_seconds_and_reset()

    def unbounded_staging(self) -> bool:
        return self.pool.limit is None

    def report_staging(self, report: MemoryReport) -> None:
        report.ssd_cached = self.cached_bytes()
        report.swap_buffers_now = self.pool.in_use - self.cached_bytes(self.pool)
        report.swap_buffers_peak = self.pool.peak_in_use
        report.param_staging_peak = self.param_pool.peak_held
        report.peak_by_tier[HOST] = (report.peak_by_tier.get(HOST, 0) + self.pool.peak_held
                                     + self.param_pool.peak_held)

    def synchronize_writes(self) -> None:
        """Wait for every write still in flight (raising the first one's error, after all have ended)."""
        errors = []
        for h in self._writes_in_flight():
            try:
                self._finish(h)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _writes_in_flight(self) -> list[SwapHandle]:
        with self._lock:
            return list(dict.fromkeys(self._writing.values()))  # oldest first

    def _finish(self, handle: SwapHandle) -> float:
        """Wait for ``handle``, then forget its keys (not before: until it has landed, a read of its shard on
        another thread must still find it and wait); the seconds blocked."""
        t0 = time.perf_counter()
        try:
            handle.wait()
        finally:
            with self._lock:
                for key in [k for k, h in self._writing.items() if h is handle]:
                    del self._writing[key]
        return time.perf_counter() - t0

    def _settle(self, keys) -> float:
        """Wait for the writes in flight to ``keys``: a page file's reads and writes keep their order. The
        seconds blocked."""
        with self._lock:
            handles = list(dict.fromkeys(h for k in keys if (h := self._writing.get(k)) is not None))
        return sum(self._finish(h) for h in handles)

    def _invalidate(self, key: str) -> None:
        """``key``'s page file is about to change: its clean copy is stale."""
        with self._lock:
            self._version[key] = self._version.get(key, 0) + 1
            stale = [self._clean.pop(key)] if key in self._clean else []
        self.release(stale)

    def _make_room(self, pool: BufferPool, nbytes: int, block: bool) -> float:
        """Make room for ``nbytes`` more in ``pool``: finished writes give their buffers back; then, while
        they do not fit, drop the oldest clean copy or, when ``block``, wait for the oldest write (a write
        holds buffers of either pool: the optimizer also writes parameter shards it took as clean copies).
        The seconds blocked."""
        waited = sum(self._finish(h) for h in self._writes_in_flight() if h.done())
        while not pool.fits(nbytes):
            with self._lock:
                victim = next((k for k, t in self._clean.items() if self._buffers[id(t)][0] is pool), None)
                t = self._clean.pop(victim) if victim is not None else None
            if t is not None:
                self.release([t])
                continue
            writes = self._writes_in_flight() if block else []
            if not writes:
                break
            waited += self._finish(writes[0])
        return waited

    def reserved(self, tier):
        ssd = (self.pool.limit or 0) + (self.param_pool.limit or 0) if tier == HOST else 0
        return ssd + super().reserved(tier)

    def close(self) -> None:
        self._finalizer()


__all__ = ["SSDStore", "SSDTierError", "prepare_swap_dir"]
