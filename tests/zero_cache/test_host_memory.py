"""glibc's malloc per phase (zero_cache/host_memory.py): in the training phase a freed block comes back without
page faults, and the engine switches to it unless reuse_freed_host_memory is false; the engine's own buffers are
mappings of their own, returned to the OS when freed."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import zero_cache
import zero_cache.builder as builder_module
from zero_cache.host_memory import START_UP_MMAP_THRESHOLD, empty_mapped

from .common import ds_config, make_model

# Page faults taken while an 8 MiB tensor is filled after a 16 MiB one was filled and freed. (Smaller than the
# freed block: torch allocates 64-byte aligned, and glibc may not fit an aligned block of the same size into the
# hole its predecessor left.)
_REFILL_FAULTS = """
import resource, sys, torch
from zero_cache import host_memory
print(getattr(host_memory, sys.argv[1])())
def fill(numel):
    t = torch.empty(numel)
    t.fill_(1.0)
fill(4 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fill(2 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.multiprocess
def test_training_phase_reuses_freed_blocks_without_page_faults():
    pages = (8 << 20) // 4096
    faults = {}
    for phase in ("set_malloc_for_start_up", "set_malloc_for_training"):  # each in a fresh process
        out = subprocess.run([sys.executable, "-c", _REFILL_FAULTS, phase], capture_output=True, text=True,
                             check=True).stdout.split()
        assert int(out[0]) > 0  # glibc took the threshold
        faults[phase] = int(out[1])
    assert faults["set_malloc_for_start_up"] >= pages // 2  # mapped afresh, faulted in page by page
    assert faults["set_malloc_for_training"] < pages // 50  # served from the heap the first one was freed to


def _mapping_at(address: int) -> tuple[int, int] | None:
    """The (start, end) of this process's mapping that holds ``address``, from /proc/self/maps."""
    with open("/proc/self/maps", encoding="ascii") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return lo, hi
    return None


def test_engine_buffers_are_mappings_of_their_own():
    nbytes = 256 << 20
    buf = empty_mapped(nbytes // 4, torch.float32, torch.device("cpu"))
    address = buf.data_ptr()
    lo, hi = _mapping_at(address)
    assert lo <= address and address + nbytes <= hi  # a mapping, not a block of a heap
    view = buf[nbytes // 8:]
    del buf
    view.fill_(2.0)  # the view keeps the mapping
    assert float(view[-1]) == 2.0 and _mapping_at(address) == (lo, hi)
    del view
    assert _mapping_at(address) is None  # unmapped with its last view
    # Below 4 MiB, a plain allocation from torch's allocator (its storage is resizable; a mapping's is not).
    doubles = START_UP_MMAP_THRESHOLD // 8
    assert empty_mapped(doubles - 1, torch.float64, torch.device("cpu")).untyped_storage().resizable()
    assert not empty_mapped(doubles, torch.float64, torch.device("cpu")).untyped_storage().resizable()


@pytest.mark.parametrize("reuse", [True, False])
def test_the_engine_switches_to_the_training_setting_unless_told_not_to(monkeypatch, reuse):
    calls = []
    monkeypatch.setattr(builder_module, "set_malloc_for_start_up", lambda: calls.append("start-up"))
    monkeypatch.setattr(builder_module, "set_malloc_for_training", lambda: calls.append("training"))
    zero_cache.initialize(model=make_model(), config=ds_config(3, 1, reuse_freed_host_memory=reuse))
    assert calls == (["start-up", "training"] if reuse else ["start-up"])
