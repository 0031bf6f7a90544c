"""Where shards of model state live: one small interface, one tier implementation for now.

Every persistent model-state tensor the engine owns (parameter shards or resident flat buffers, fp32
masters, gradient shards, Adam moments) is allocated through a ``ShardStore`` under a key, with a *kind*
(what it is) and a *tier* (where it lives). The engine never calls ``torch.empty`` for model state
itself, so a later store can put a tier on SSD or move shards between tiers without engine changes,
and the byte accounting (``memory_report``) is exact by construction.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .aio import BufferPool
from .pinned_memory import CudaPinning, HostArena, Pinning

KINDS = ("params", "grads", "optimizer")
DEVICE, HOST, NVME = "device", "host", "nvme"
TIERS = (DEVICE, HOST, NVME)


@dataclass
class MemoryReport:
    """Bytes of model state held by this rank, per kind and per tier, plus transient gather buffers."""
    by_kind: dict[str, int] = field(default_factory=dict)
    by_tier: dict[str, int] = field(default_factory=dict)
    by_kind_tier: dict[tuple[str, str], int] = field(default_factory=dict)
    gathered_now: int = 0
    gathered_peak: int = 0
    gathered_reserved: int = 0  # the max_contigous_params_size arena, allocated once (0: none)
    swap_buffers_now: int = 0  # aligned host staging buffers of the SSD tier in use by I/O or the optimizer, bytes
    swap_buffers_peak: int = 0  # (clean copies included)
    ssd_cached: int = 0  # staging buffers held as clean copies of SSD shards (both pools; dropped when room is needed)
    param_staging_peak: int = 0  # host buffers of SSD parameter shards read for gathers (peak held)
    copy_staging: int = 0  # pinned host staging of host <-> device copies (held; the pools never shrink)
    budget: dict[str, int] = field(default_factory=dict)  # bytes allowed per tier
    peak_by_tier: dict[str, int] = field(default_factory=dict)  # shards + peak staging buffers held (host)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __str__(self) -> str:
        kinds = ", ".join(f"{k}={v / 2**20:.2f}MiB" for k, v in self.by_kind.items())
        tiers = ", ".join(
            f"{t}={v / 2**20:.2f}MiB [" + " ".join(f"{k}={n / 2**20:.2f}" for (k, tt), n in self.by_kind_tier.items()
                                                    if tt == t) + "]" for t, v in self.by_tier.items())
        swap = (f"; SSD staging buffers now {self.swap_buffers_now / 2**20:.2f}MiB, peak "
                f"{self.swap_buffers_peak / 2**20:.2f}MiB, clean copies {self.ssd_cached / 2**20:.2f}MiB"
                ) if self.by_tier.get(NVME) else ""
        arena = f" of a {self.gathered_reserved / 2**20:.2f}MiB arena" if self.gathered_reserved else ""
        return (f"model states {self.total / 2**20:.2f}MiB ({kinds}; {tiers}); gathered params now "
                f"{self.gathered_now / 2**20:.2f}MiB, peak {self.gathered_peak / 2**20:.2f}MiB{arena}{swap}")


class ShardStore(ABC):
    """Owner of every persistent model-state tensor; tensors are addressed by a string key."""

    transfer_pool: BufferPool  # aligned host buffers of range transfers (checkpoint slices, SSD pieces), accounted

    @abstractmethod
    def allocate(self, key: str, kind: str, tier: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Create a zero-filled flat tensor under ``key`` and return it."""

    @abstractmethod
    def get(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key`` (usable in place)."""

    @abstractmethod
    def put(self, key: str, value: torch.Tensor) -> None:
        """Copy ``value`` into the tensor stored under ``key`` (same numel; dtype/tier converted)."""

    @abstractmethod
    def tier_of(self, key: str) -> str:
        """The tier ``key`` lives in."""

    @abstractmethod
    def nbytes(self) -> dict[tuple[str, str], int]:
        """Bytes held per (kind, tier)."""

    def read(self, key: str) -> torch.Tensor:
        """A host copy of ``key``'s values (works for every tier, SSD included)."""
        return self.get(key).detach().cpu().clone()

    @abstractmethod
    def read_range(self, key: str, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [lo, hi) of ``key`` copied into ``out`` (a new host tensor when None; dtype converted).

        SSD shards are read in aligned pieces through one ``transfer_pool`` buffer, never whole."""

    @abstractmethod
    def write_range(self, key: str, lo: int, value: torch.Tensor) -> None:
        """Copy ``value`` into elements [lo, lo + value.numel()) of ``key`` (dtype converted).

        The copy is complete when this returns, so ``value`` may be freed or unmapped right after."""

    def swap_in(self, keys: list[str], for_gather: bool = False, optional: bool = False,
                params: bool = False) -> "SwapHandle | None":
        """Start reading SSD-tier ``keys`` into host staging buffers; ``wait()`` returns the tensors.

        ``for_gather``: parameter shards read for an all-gather (their own accounted buffer pool, outside the
        optimizer's I/O statistics). ``params``: parameter shards into that pool, for the optimizer.
        ``optional``: return None instead of failing when the staging reserve is full (read-ahead). A shard
        with a clean copy is served from it, without I/O."""
        raise ValueError(f"this store has no SSD tier; shards {keys} cannot be swapped in")

    def staging(self, keys: list[str]) -> list[torch.Tensor]:
        """Host staging buffers for SSD-tier ``keys`` whose contents will be overwritten (not read)."""
        raise ValueError(f"this store has no SSD tier; shards {keys} have no staging buffers")

    def swap_out(self, keys: list[str], tensors: list[torch.Tensor], keep=()) -> "SwapHandle":
        """Start writing swapped-in tensors back to SSD and recycle their buffers once written (the parameter
        shards of ``keep`` stay cached as clean copies while the parameter pool has room). Nobody has to wait
        for the handle: later access to these shards waits for the write first."""
        raise ValueError(f"this store has no SSD tier; shards {keys} cannot be swapped out")

    def release(self, tensors: list[torch.Tensor], clean: bool = False) -> None:
        """Hand swapped-in tensors' staging buffers back without writing them; ``clean``: they are unchanged
        and may stay cached as clean copies."""
        raise ValueError("this store has no SSD tier; nothing was swapped in")

    def held_unchanged(self, key: str) -> bool:
        """Whether a tensor swapped in (not cached) holds ``key``'s current contents: released clean, it will
        serve the next ``swap_in`` of ``key`` without I/O."""
        return False

    def room(self, tier: str) -> int | None:
        """Bytes ``tier`` can still allocate under its budget (None: no budget)."""
        return None

    def io_totals_and_reset(self) -> tuple[float, int, int]:
        """(seconds with SSD I/O in flight, bytes read, bytes written) of the optimizer's transfers since the last
        call (gathers' reads are not counted); zeros for a store without an SSD tier."""
        return 0.0, 0, 0

    def unbounded_staging(self) -> bool:
        """Whether the SSD tier's staging pool has no byte limit (then its users bound the buffers they hold)."""
        return False

    def report_staging(self, report: MemoryReport) -> None:  # noqa: B027 (only the SSD tier has staging)
        """Add the SSD tier's staging buffers (now, peak, clean copies) to ``report``."""

    def synchronize_writes(self) -> None:  # noqa: B027 (only the SSD tier has writes in flight)
        """Wait for every ``swap_out`` still in flight; raise the first failure."""

    def close(self) -> None:  # noqa: B027 (optional hook: only the SSD tier has files and threads)
        """Release files and threads (the SSD tier removes its swap directory)."""


def check_range(key: str, lo: int, hi: int, numel: int) -> None:
    if not 0 <= lo <= hi <= numel:
        raise IndexError(f"shard '{key}' holds {numel} elements; range [{lo}, {hi}) is outside it")


class SwapHandle:
    """An SSD transfer in flight; ``wait()`` returns its tensors and counts the time spent blocked.

    Any thread may wait, more than once: the first wait runs the completion (``on_wait(failed)``: buffers
    go back to their pool) and raises the transfer's error; later ones return at once."""

    def __init__(self, futures, result, on_wait=None, on_error=None):
        self._futures, self._result = futures, result
        self._on_wait, self._on_error = on_wait, on_error
        self._lock = threading.Lock()
        self.waited = 0.0

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self):
        t0 = time.perf_counter()
        with self._lock:
            errors = []
            for f in self._futures:
                try:
                    f.result()
                except BaseException as e:  # wait for every job before raising, so no buffer is still in use
                    errors.append(e)
            self._futures = []
            self.waited += time.perf_counter() - t0
            if self._on_wait is not None:
                self._on_wait(bool(errors))
                self._on_wait = None
            if errors:
                if self._on_error is not None:
                    self._on_error()
                    self._on_error = None
                raise errors[0]
        return self._result


class DeviceHostStore(ShardStore):
    """Two tiers: the compute device and host memory (pinned when the device is an accelerator)."""

    def __init__(self, device: torch.device, pin_host: bool = False, budgets: dict[str, int] | None = None,
                 pinning: Pinning | None = None, copy_staging: int = 0, host_bytes: int = 0):
        """``pinning``: how the compute device pins host memory (streams.Streams.pinning; None: nothing to pin).
        With ``pin_host`` the host-tier shards are carved from one pinned arena of ``host_bytes`` (the
        placement's host shards, ``HostArena.reserve_for``), made here."""
        self.device = torch.device(device)
        if pinning is None and self.device.type == "cuda":
            pinning = CudaPinning()
        self.pinning = pinning
        self.host_arena = HostArena(pinning, host_bytes) if pin_host and pinning is not None else None
        self.copy_staging = copy_staging  # host bytes of the pinned staging pools of host <-> device copies
        self.budgets = dict(budgets or {})
        self._tensors: dict[str, torch.Tensor] = {}
        self._meta: dict[str, tuple[str, str]] = {}
        self._tier_bytes = dict.fromkeys(TIERS, 0)
        self.transfer_pool = BufferPool()

    def _charge(self, key: str, tier: str, nbytes: int) -> None:
        """Account ``nbytes`` to ``tier``; refuse (before allocating) what would exceed its budget."""
        limit = self.budgets.get(tier)
        if limit is not None and self._tier_bytes[tier] + nbytes + self.reserved(tier) > limit:
            raise MemoryError(f"zero_cache: allocating shard '{key}' ({nbytes} bytes) would exceed the {tier} "
                              f"budget: {self._tier_bytes[tier] + self.reserved(tier)} of {limit} bytes in use; "
                              f"raise zero_optimization.memory_budget.{tier} or move states to another tier")
        self._tier_bytes[tier] += nbytes

    def reserved(self, tier: str) -> int:
        """Bytes of ``tier`` set aside outside the shards (pinned copy staging on the host)."""
        return self.copy_staging if tier == HOST else 0

    def room(self, tier: str) -> int | None:
        """Bytes ``tier`` can still allocate under its budget (None: no budget)."""
        limit = self.budgets.get(tier)
        return None if limit is None else limit - self._tier_bytes[tier] - self.reserved(tier)

    def allocate(self, key, kind, tier, numel, dtype):
        if key in self._tensors:
            raise KeyError(f"shard '{key}' is already allocated")
        if kind not in KINDS or tier not in (DEVICE, HOST):
            raise ValueError(f"bad kind/tier {kind!r}/{tier!r} for DeviceHostStore; kinds {KINDS}, tiers "
                             f"{(DEVICE, HOST)} (the '{NVME}' tier needs zero_cache.ssd_store.SSDStore)")
        self._charge(key, tier, numel * torch.empty((), dtype=dtype).element_size())
        if tier == HOST and self.host_arena is not None:
            t = self.host_arena.carve(numel, dtype)
        else:
            t = torch.zeros(numel, dtype=dtype, device=self.device if tier == DEVICE else torch.device("cpu"))
        self._tensors[key] = t
        self._meta[key] = (kind, tier)
        return t

    def get(self, key):
        return self._tensors[key]

    def put(self, key, value):
        dst = self._tensors[key]
        if value.numel() != dst.numel():
            raise ValueError(f"shard '{key}' holds {dst.numel()} elements, got {value.numel()}")
        dst.copy_(value.reshape(-1))  # done on return: the caller may reuse value, and read dst on the host

    def read_range(self, key, lo, hi, out=None):
        src = self._tensors[key]
        check_range(key, lo, hi, src.numel())
        if out is None:
            return src[lo:hi].to("cpu", copy=True)
        return out.copy_(src[lo:hi])

    def write_range(self, key, lo, value):
        dst = self._tensors[key]
        value = value.reshape(-1)
        check_range(key, lo, lo + value.numel(), dst.numel())
        dst[lo:lo + value.numel()].copy_(value)  # synchronous: the caller may drop value next

    def tier_of(self, key):
        return self._meta[key][1]

    def nbytes(self):
        out: dict[tuple[str, str], int] = {}
        for key, t in self._tensors.items():
            out[self._meta[key]] = out.get(self._meta[key], 0) + t.numel() * t.element_size()
        return out
