"""SSD tier I/O: checksummed, block-aligned page files, aligned host buffers and a pool of I/O threads.

A *page file* holds one shard: a 4 KiB header (magic, key, dtype, element count, payload bytes, XXH3-64
checksum of the payload) followed by the payload padded to a multiple of 4 KiB, so every read and write is
block-aligned and can bypass the page cache with ``O_DIRECT`` (where the filesystem refuses it the file
is reopened without, once, with a warning). Payloads move between the file and *aligned buffers*
(anonymous ``mmap`` memory: page-aligned, as ``O_DIRECT`` requires) in ``aio.block_size`` pieces with
``os.preadv`` / ``os.pwritev``, which release the GIL, so I/O runs while torch kernels compute.

``AioEngine`` runs whole-file jobs, at most ``aio.queue_depth x aio.intra_op_parallelism`` at once, reads
before writes, and records each job's busy interval so callers can measure how much I/O time their compute
hid. A job moves its file's blocks on a pool of that many block threads (DeepSpeed's aio meaning of the two
keys: requests outstanding per thread, times threads) and chains the checksum over the blocks in order
while later ones are still moving, so it costs no I/O time. The checksum is XXH3-64 (the ``xxhash``
package, which releases the GIL): about 7.5 GB/s on one core here, where zlib's CRC-32 runs at about
2 GB/s, no faster than a fast disk reads; and it is 64 bits wide.
Checkpoints move byte ranges of a page file instead (``read_span`` / ``write_span``, in the caller's
thread), through a buffer of one block, so a shard never has to fit in host memory whole.
A truncated or corrupted page file, or a full disk, is an ``SSDTierError`` naming the file.
"""
from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import queue
import shutil
import struct
import sys
import threading
import time
import weakref
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Callable

import torch
import xxhash

from .config import AioConfig

logger = logging.getLogger(__name__)

ALIGN = 4096
HEADER_BYTES = ALIGN
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
MAGIC = b"ZCPAGE02"
_HEADER = struct.Struct("<8sQQQQH")  # magic, numel, payload bytes, capacity, XXH3-64 of the payload, key length


class SSDTierError(RuntimeError):
    """A problem with the SSD tier (path, space, or a damaged page file); the message names the file."""


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


def nearest_existing_dir(path: str) -> str:
    """``path`` or its closest existing ancestor (a swap directory is created later, below it)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def check_writable(nvme_path: str) -> None:
    """Refuse an nvme_path that cannot take page files before its free space is measured: a read-only
    filesystem would otherwise read as one with too little space."""
    where = nearest_existing_dir(nvme_path)
    fix = ("point offload_optimizer/offload_param.nvme_path at a writable directory on a local SSD, or remount "
           "its filesystem read-write")
    if os.statvfs(where).f_flag & os.ST_RDONLY:
        raise SSDTierError(f"SSD tier: nvme_path '{nvme_path}' is on a read-only filesystem ('{where}' is mounted "
                           f"read-only); {fix}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise SSDTierError(f"SSD tier: nvme_path '{nvme_path}' is not writable (no write permission on "
                           f"'{where}'); {fix}")


class AlignedBuffer:
    """Page-aligned host memory (a private anonymous mmap) viewed as a uint8 tensor of ``capacity`` bytes.

    A buffer of a huge page or more asks for transparent huge pages (``MADV_HUGEPAGE``; the kernel's default
    THP mode, ``madvise``, gives them only to regions that ask): an ``O_DIRECT`` request over scattered 4 KiB
    pages is split by the block layer, over a huge page it is one 2 MiB segment (docs/zero_cache/
    tiers-and-ssd.md, "Huge pages for staging"). With a ``pinning`` (pinned_memory.py) the mapping is pinned
    in place, so a device copies to and from it directly."""

    def __init__(self, capacity: int, pinning=None):
        self.capacity = round_up(max(capacity, 1))
        # Private, so that resize() can grow it: a shared anonymous mapping cannot grow past its first size.
        self.mm = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._ask_for_huge_pages()
        self._pinning = pinning  # pinned_memory.Pinning: the mapping is pinned in place while it lives
        self._unpin: weakref.finalize | None = None
        self._pin()

    def _pin(self) -> None:
        if self._pinning is None:
            return
        ptr = torch.frombuffer(self.mm, dtype=torch.uint8, count=1).data_ptr()
        if self._pinning.register(ptr, self.capacity):
            # Unpinned when the mapping goes, which is after the last tensor viewing it.
            self._unpin = weakref.finalize(self.mm, self._pinning.unregister, ptr)

    def _ask_for_huge_pages(self) -> None:
        if self.capacity >= HUGE_PAGE and _MADV_HUGEPAGE is not None:
            try:
                self.mm.madvise(_MADV_HUGEPAGE)  # the flag stays with the mapping through mremap
            except OSError:  # a kernel built without transparent huge pages: 4 KiB pages then
                pass

    def resize(self, capacity: int) -> bool:
        """Grow or shrink (``mremap``, which may move it): the pages kept stay mapped, so only new ones fault
        and get zeroed. False while anything still views the buffer: a tensor from ``view`` holds a reference
        to the mapping (not a buffer export, which mmap would refuse to resize under), and moving the memory
        under it would leave it pointing at unmapped pages."""
        if sys.getrefcount(self.mm) > 2:  # this attribute and the call's argument
            return False
        if self._unpin is not None:
            self._unpin()  # the pages may move: pinned again below, at their new place
            self._unpin = None
        try:
            self.mm.resize(capacity)
        except (BufferError, OSError, SystemError):  # a memoryview of it is alive, or no mremap here
            self._pin()
            return False
        self.capacity = capacity
        self._ask_for_huge_pages()  # a buffer grown past a huge page
        self._pin()
        return True

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements; the tensor's storage is exactly those bytes (torch.save writes no more)."""
        return torch.frombuffer(self.mm, dtype=dtype, count=numel)


class BufferPool:
    """Reused aligned buffers, free lists by capacity; exact accounting of the bytes it holds."""

    def __init__(self, limit: int | None = None, pinning=None):
        self.limit = limit  # bytes the pool may hold (in use + free); None = unbounded
        self.pinning = pinning  # pinned_memory.Pinning of its buffers (a device copies to and from them)
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._lock = threading.Lock()
        self.held = 0  # bytes of all buffers this pool holds (in use or free)
        self.peak_held = 0
        self.in_use = 0
        self.peak_in_use = 0

    def acquire(self, nbytes: int) -> AlignedBuffer:
        cap = round_up(max(nbytes, 1))
        with self._lock:
            free = self._free.get(cap)
            buf = free.pop() if free else None
            if buf is None:
                reused = None
                if self.limit is not None and self.held + cap > self.limit:
                    # Make room from the free buffers of other sizes. The one nearest in size is resized rather
                    # than unmapped, so that its pages are not faulted and zeroed again; the rest are dropped.
                    reused = self._pop_nearest(cap)
                    for other in list(self._free):
                        while self._free[other] and self.held + cap > self.limit:
                            self.held -= self._free[other].pop().capacity
                    if self.held + cap > self.limit:
                        raise MemoryError(f"zero_cache SSD tier: staging buffers would need {self.held + cap} bytes, "
                                          f"more than the {self.limit} bytes reserved for them in the host budget")
                buf = reused if reused is not None and reused.resize(cap) else AlignedBuffer(cap, self.pinning)
                self.held += cap
                self.peak_held = max(self.peak_held, self.held)
            self.in_use += cap
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def _pop_nearest(self, cap: int) -> AlignedBuffer | None:
        """Take the free buffer nearest ``cap`` bytes out of the pool's accounting (the smallest larger one, else
        the largest); the caller holds the lock."""
        sizes = [c for c, bufs in self._free.items() if bufs]
        if not sizes:
            return None
        larger = [c for c in sizes if c > cap]
        buf = self._free[min(larger) if larger else max(sizes)].pop()
        self.held -= buf.capacity
        return buf

    def give(self, buf: AlignedBuffer, dst: "BufferPool") -> bool:
        """Move ``buf`` (in use, from this pool) to ``dst``'s accounting, without copying; False when ``dst``
        cannot hold it even after dropping its free buffers."""
        cap = buf.capacity
        first, second = sorted((self, dst), key=id)
        with first._lock, second._lock:
            if dst.limit is not None:
                for other in list(dst._free):
                    while dst._free[other] and dst.held + cap > dst.limit:
                        dst.held -= dst._free[other].pop().capacity
                if dst.held + cap > dst.limit:
                    return False
            self.in_use -= cap
            self.held -= cap
            dst.in_use += cap
            dst.held += cap
            dst.peak_in_use = max(dst.peak_in_use, dst.in_use)
            dst.peak_held = max(dst.peak_held, dst.held)
        return True

    def fits(self, nbytes: int) -> bool:
        """Whether ``acquire(nbytes)`` would succeed now (free buffers of other sizes can be dropped)."""
        cap = round_up(max(nbytes, 1))
        with self._lock:
            return self.limit is None or bool(self._free.get(cap)) or self.in_use + cap <= self.limit

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self.in_use -= buf.capacity
            self._free.setdefault(buf.capacity, []).append(buf)

    def trim(self) -> None:
        """Drop the free buffers (their memory goes back to the system once no tensor views them)."""
        with self._lock:
            for bufs in self._free.values():
                self.held -= sum(b.capacity for b in bufs)
            self._free = {}


class PageFile:
    """One shard on SSD: header + block-aligned payload, preallocated at creation."""

    def __init__(self, path: str, key: str, numel: int, dtype: torch.dtype, direct: bool):
        self.path, self.key, self.numel, self.dtype = path, key, numel, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.payload = numel * self.itemsize
        self.capacity = round_up(max(self.payload, 1))
        self.file_bytes = HEADER_BYTES + self.capacity
        self.direct = direct
        self.checksum_known = True  # False while range writes have left the header's checksum stale
        self.io_checked = False  # a request went through: O_DIRECT is not refused at I/O time
        self._read_pass: tuple[int, xxhash.xxh3_64] | None = None  # (next byte, running checksum) of range reads
        self._write_pass: tuple[int, xxhash.xxh3_64] | None = None
        self.fd = self._open(create=True)
        try:
            os.posix_fallocate(self.fd, 0, self.file_bytes)
        except OSError as e:
            os.close(self.fd)
            os.unlink(path)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SSDTierError(_no_space(path, self.file_bytes)) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise SSDTierError(f"SSD tier: cannot preallocate {self.file_bytes} bytes for '{path}': {e}") from None
            self.fd = self._open(create=True)

    def _open(self, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        if self.direct:
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise SSDTierError(f"SSD tier: cannot open page file '{self.path}': {e}") from None
                self._drop_direct("open")
        try:
            return os.open(self.path, flags, 0o600)
        except OSError as e:
            raise SSDTierError(f"SSD tier: cannot open page file '{self.path}': {e}") from None

    def _drop_direct(self, what: str) -> None:
        logger.warning("zero_cache SSD tier: the filesystem of '%s' refuses O_DIRECT (%s); using buffered I/O",
                       os.path.dirname(self.path), what)
        self.direct = False

    def _io(self, write: bool, mv: memoryview, offset: int, block: int) -> None:
        done = 0
        while done < len(mv):
            piece = mv[done:done + block]
            try:
                n = (os.pwritev if write else os.preadv)(self.fd, [piece], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and self.direct:  # O_DIRECT accepted at open, refused at I/O
                    self._drop_direct("I/O")
                    os.close(self.fd)
                    self.fd = self._open(create=False)
                    continue
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise SSDTierError(_no_space(self.path, self.file_bytes)) from None
                raise SSDTierError(f"SSD tier: {'writing' if write else 'reading'} '{self.path}' failed: {e}") from None
            if n == 0:
                raise SSDTierError(f"SSD tier: page file '{self.path}' is truncated (read past its end at byte "
                                   f"{offset + done}; expected {self.file_bytes} bytes)")
            done += n

    def _io_pieces(self, write: bool, mv: memoryview, offset: int, block: int, pool: Executor | None,
                   checked_bytes: int, header: Callable[[], int] | None = None) -> tuple[int, int | None]:
        """Move ``mv`` in ``block`` pieces, concurrently on ``pool`` when given. Returns the checksum of its first
        ``checked_bytes`` bytes, chained piece by piece in order as they complete (reads) or are queued (writes),
        and what ``header`` returned (a read's header check, run in this thread while the pieces move)."""
        pieces = [(start, min(start + block, len(mv))) for start in range(0, len(mv), block)]
        if pool is None or len(pieces) == 1:
            recorded = header() if header is not None else None
            self._io(write, mv, offset, block)
            return xxhash.xxh3_64_intdigest(mv[:checked_bytes]), recorded
        first = 0
        if not self.io_checked:  # one request alone first: O_DIRECT may be refused there, reopening the file
            a, b = pieces[0]
            self._io(write, mv[a:b], offset + a, block)
            self.io_checked, first = True, 1
        futures = [None] * first
        futures += [pool.submit(self._io, write, mv[a:b], offset + a, block) for a, b in pieces[first:]]
        digest = xxhash.xxh3_64()
        try:
            recorded = header() if header is not None else None
            for (a, b), f in zip(pieces, futures):
                if f is not None and not write:
                    f.result()
                digest.update(mv[a:min(b, checked_bytes)])  # empty past the payload (padding)
            for f in futures[first:]:
                f.result()
        finally:  # never return while a request still uses the caller's buffer
            wait(futures[first:])
        return digest.intdigest(), recorded

    def write(self, buf: AlignedBuffer, block: int, pool: Executor | None = None) -> None:
        """Write ``buf``'s first ``payload`` bytes (its tail up to capacity is padding) and a fresh header."""
        digest, _ = self._io_pieces(True, memoryview(buf.mm)[:self.capacity], HEADER_BYTES, block, pool, self.payload)
        self._write_header(digest)
        self._read_pass = self._write_pass = None

    def _write_header(self, digest: int) -> None:
        header = AlignedBuffer(HEADER_BYTES)
        key = self.key.encode()[:HEADER_BYTES - _HEADER.size]
        _HEADER.pack_into(header.mm, 0, MAGIC, self.numel, self.payload, self.capacity, digest, len(key))
        header.mm[_HEADER.size:_HEADER.size + len(key)] = key
        self._io(True, memoryview(header.mm), 0, HEADER_BYTES)
        self.checksum_known = True

    def _header_checksum(self) -> int:
        """Check the file size and the header; the payload checksum the header records."""
        size = os.fstat(self.fd).st_size
        if size < self.file_bytes:
            raise SSDTierError(f"SSD tier: page file '{self.path}' is truncated: {size} bytes, expected "
                               f"{self.file_bytes} (shard '{self.key}'); the swap directory was modified or the "
                               f"disk failed")
        header = AlignedBuffer(HEADER_BYTES)
        self._io(False, memoryview(header.mm), 0, HEADER_BYTES)
        magic, numel, payload, capacity, digest, _ = _HEADER.unpack_from(header.mm, 0)
        if magic != MAGIC or numel != self.numel or payload != self.payload or capacity != self.capacity:
            raise SSDTierError(f"SSD tier: page file '{self.path}' has a corrupted header (magic {magic!r}, "
                               f"{numel} elements / {payload} bytes, expected {self.numel} / {self.payload})")
        return digest

    def _check_checksum(self, got: int, recorded: int) -> None:
        if not self.checksum_known:  # range writes left the header's checksum stale: this full pass re-establishes it
            self._write_header(got)
        elif got != recorded:
            raise SSDTierError(f"SSD tier: page file '{self.path}' is corrupted: payload checksum {got:#018x}, "
                               f"header says {recorded:#018x} (shard '{self.key}')")

    def read(self, buf: AlignedBuffer, block: int, pool: Executor | None = None) -> None:
        """Fill ``buf`` with the payload; verify file size, header and checksum first/after."""
        got, recorded = self._io_pieces(False, memoryview(buf.mm)[:self.capacity], HEADER_BYTES, block, pool,
                                        self.payload, header=self._header_checksum)
        self._check_checksum(got, recorded)

    # ---- byte ranges (checkpoints) ----------------------------------------------------------------------
    # A range lives in ``buf`` at its offset from ``start`` rounded down to 4 KiB, so whole pages move.
    # Consecutive ranges from byte 0 to the end form a *pass* whose running checksum verifies the payload
    # (reads) or becomes the header's (writes). Any other write makes the header's checksum stale until the
    # next full read or read pass, which records the checksum it computes.

    def read_span(self, buf: AlignedBuffer, start: int, stop: int, block: int) -> None:
        """Payload bytes [start, stop) into ``buf``; file size and header checked, checksum at the end of a pass."""
        recorded = self._header_checksum()
        base = start - start % ALIGN
        mv = memoryview(buf.mm)[:round_up(stop) - base]
        self._io(False, mv, HEADER_BYTES + base, block)
        running = _extend(self._read_pass, start, mv[start - base:stop - base])
        self._read_pass = (stop, running) if running is not None and stop < self.payload else None
        if running is not None and stop == self.payload:
            self._check_checksum(running.intdigest(), recorded)

    def fill_edges(self, buf: AlignedBuffer, start: int, stop: int) -> None:
        """Read the partly covered first and last pages of [start, stop) into ``buf`` before ``write_span``
        overwrites whole pages, so the bytes around the range are kept."""
        base = start - start % ALIGN
        last = stop - stop % ALIGN
        mv = memoryview(buf.mm)
        if start % ALIGN:
            self._io(False, mv[:ALIGN], HEADER_BYTES + base, ALIGN)
        if stop % ALIGN and not (start % ALIGN and last == base):
            self._io(False, mv[last - base:last - base + ALIGN], HEADER_BYTES + last, ALIGN)

    def write_span(self, buf: AlignedBuffer, start: int, stop: int, block: int) -> None:
        """Write payload bytes [start, stop) from ``buf`` (after ``fill_edges``); a finished pass writes the header."""
        base = start - start % ALIGN
        mv = memoryview(buf.mm)[:round_up(stop) - base]
        running = _extend(self._write_pass, start, mv[start - base:stop - base])
        self._io(True, mv, HEADER_BYTES + base, block)
        self._read_pass = None
        self.checksum_known = False
        self._write_pass = (stop, running) if running is not None and stop < self.payload else None
        if running is not None and stop == self.payload:
            self._write_header(running.intdigest())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _extend(progress: tuple[int, xxhash.xxh3_64] | None, start: int, data: memoryview) -> xxhash.xxh3_64 | None:
    """The running checksum of a pass after ``data`` (payload bytes from ``start``); None when it does not
    continue one."""
    if start == 0:
        running = xxhash.xxh3_64()
    elif progress is not None and progress[0] == start:
        running = progress[1]
    else:
        return None
    running.update(data)
    return running


def spans(start: int, stop: int, window: int):
    """[start, stop) in consecutive pieces whose 4 KiB-aligned cover fits in ``window`` bytes (a multiple of 4 KiB)."""
    while start < stop:
        end = min(stop, start - start % ALIGN + window)
        yield start, end
        start = end


def _no_space(path: str, needed: int) -> str:
    free = disk_free(os.path.dirname(path))
    return (f"SSD tier: no space left for '{path}': {needed} bytes needed, {free} bytes free on its filesystem; "
            f"free space, point nvme_path at a larger disk or keep more states on the host")


class AioEngine:
    """Worker threads for page-file jobs: reads before writes, busy-time and byte accounting.

    A job waits in one priority queue; ``queue_depth x intra_op_parallelism`` workers take reads first,
    then writes in the order they came. A write submitted at the end of an optimizer step can then drain
    while the next forward runs without delaying that forward's reads; the store keeps each page file's
    reads and writes in order (ssd_store.py). Submitting never blocks: the caller already holds the job's
    buffer, so the bound on memory is the buffer pool's, not the queue's."""

    _READ, _WRITE, _STOP = 0, 1, 2

    def __init__(self, cfg: AioConfig):
        self.block = cfg.block_size
        self.threads = cfg.intra_op_parallelism
        in_flight = cfg.queue_depth * self.threads
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._workers = [threading.Thread(target=self._serve, name=f"zero_cache_aio_{i}", daemon=True)
                         for i in range(in_flight)]
        for t in self._workers:
            t.start()
        self._blocks = ThreadPoolExecutor(max_workers=in_flight,
                                          thread_name_prefix="zero_cache_aio_block") if in_flight > 1 else None
        self._lock = threading.Lock()
        self._since = time.perf_counter()  # start of the accounting window
        self._running: dict[int, float] = {}  # job -> start time, for jobs still moving bytes
        self.intervals: list[tuple[float, float]] = []
        self.bytes_read = 0
        self.bytes_written = 0

    def _serve(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            future, write, page, buf, account = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self._run(write, page, buf, account)
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(None)

    def _run(self, write: bool, page: PageFile, buf: AlignedBuffer, account: bool) -> None:
        token = next(self._order)
        t0 = time.perf_counter()
        if account:
            with self._lock:
                self._running[token] = t0
        try:
            (page.write if write else page.read)(buf, self.block, self._blocks)
        finally:
            if account:
                t1 = time.perf_counter()
                with self._lock:
                    del self._running[token]
                    self.intervals.append((t0, t1))

    def submit(self, write: bool, page: PageFile, buf: AlignedBuffer, account: bool = True) -> Future:
        """Queue a whole-file job; ``account=False`` leaves it out of ``busy_seconds_and_reset`` (parameter
        reads for gathers, which run beside the optimizer's traffic that the busy time describes)."""
        future: Future = Future()
        if account:
            with self._lock:
                if write:
                    self.bytes_written += page.file_bytes
                else:
                    self.bytes_read += page.file_bytes
        self._queue.put((self._WRITE if write else self._READ, next(self._order),
                         (future, write, page, buf, account)))
        return future

    def busy_seconds_and_reset(self) -> tuple[float, int, int]:
        """Since the last call: wall time during which at least one job ran (union of intervals, jobs still
        running counted up to now), bytes of the jobs submitted (read, written); then a new window starts."""
        now = time.perf_counter()
        with self._lock:
            since, self._since = self._since, now
            spans = [(max(a, since), b) for a, b in self.intervals if b > since]
            spans += [(max(a, since), now) for a in self._running.values()]
            self.intervals = []
            r, w = self.bytes_read, self.bytes_written
            self.bytes_read = self.bytes_written = 0
        busy, end = 0.0, float("-inf")
        for a, b in sorted(spans):
            if b <= end:
                continue
            busy += b - max(a, end)
            end = b
        return busy, r, w

    def shutdown(self) -> None:
        """Finish every queued job, then stop the workers."""
        for _ in self._workers:
            self._queue.put((self._STOP, next(self._order), None))
        for t in self._workers:
            t.join()
        self._workers = []
        if self._blocks is not None:
            self._blocks.shutdown(wait=True)
