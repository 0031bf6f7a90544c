"""Pointing a storage at memory it does not own, so that every view of it follows.

A stage-3 chunk keeps one storage object for life: parameters and the tensors autograd saved are views of
it. The gathered-parameter arena (param_arena.py) and the CPU's private mappings (partition.py) move only
the memory behind that storage, which needs to replace a storage's data pointer and size in place.

Two mechanisms, the first that this torch has:

- ``UntypedStorage._swap_data_ptr_`` (torch 2.13 and newer), with a storage made from the data pointer;
- a native helper of a few lines (``storage_pointer.cpp`` beside this file) that sets the pointer and size
  of the storage's C++ ``StorageImpl`` through the public c10 header torch ships. It is compiled once per
  torch version with the machine's C++ compiler (about a second) into ``ZERO_CACHE_BUILD_DIR`` (default
  ``~/.cache/zero_cache``) and loaded with ctypes; ranks that build at once each write a file of their own
  and rename it into place.

Where neither is available (an older torch and no compiler) ``mechanism()`` is None and callers fall back to
allocations of their own, saying so. ``ZERO_CACHE_STORAGE_POINTER=native`` uses the helper even where
``_swap_data_ptr_`` exists (the tests of the fallback run so on every torch).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

SWAP, NATIVE = "swap_data_ptr", "native"
_SOURCE = Path(__file__).with_name("storage_pointer.cpp")


class StoragePointerError(RuntimeError):
    """No way to point a storage at foreign memory on this torch (see ``unavailable_reason``)."""


def mechanism() -> str | None:
    """The mechanism ``point`` uses: ``SWAP``, ``NATIVE``, or None when this torch offers neither."""
    native_first = os.environ.get("ZERO_CACHE_STORAGE_POINTER") == NATIVE
    if not native_first and hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return SWAP
    return NATIVE if _native() is not None else None


def unavailable_reason() -> str:
    """Why ``mechanism()`` is None, in one line."""
    return (f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_ (torch 2.13+) and the native helper "
            f"could not be built: {_native_error() or 'unknown error'}")


def point(storage: torch.UntypedStorage, ptr: int, nbytes: int, device: torch.device) -> None:
    """Make ``storage`` use ``nbytes`` at address ``ptr`` without owning them (ptr 0: an empty storage). What it
    held before is released as a resize to zero would release it. Views of the storage follow."""
    how = mechanism()
    if how == SWAP:
        if nbytes:
            other = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
        else:
            other = torch.UntypedStorage(0, device=device)
        storage._swap_data_ptr_(other)
    elif how == NATIVE:
        device = torch.device(device)
        index = device.index if device.index is not None else (-1 if device.type == "cpu" else 0)
        _native()(storage._cdata, ptr, nbytes, _DEVICE_TYPES[device.type], index)
    else:
        raise StoragePointerError(unavailable_reason())


# c10::DeviceType values (c10/core/DeviceType.h) of the devices a chunk can live on.
_DEVICE_TYPES = {"cpu": 0, "cuda": 1}


def build_dir() -> Path:
    return Path(os.environ.get("ZERO_CACHE_BUILD_DIR") or Path.home() / ".cache" / "zero_cache")


@functools.lru_cache(maxsize=1)
def _build() -> tuple[Callable | None, str | None]:
    """(the helper's function, None) or (None, why it is not there). Built at most once per process."""
    include = Path(torch.__file__).parent / "include"
    lib = Path(torch.__file__).parent / "lib"
    if not (include / "c10" / "core" / "StorageImpl.h").is_file():
        return None, f"this torch ships no C++ headers ({include})"
    source = _SOURCE.read_bytes()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    key = hashlib.sha1(source + f"{torch.__version__}|{torch.__file__}|{abi}".encode()).hexdigest()[:16]
    target = build_dir() / f"storage_pointer-{key}.so"
    if not target.is_file():
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        if compiler is None:
            return None, "no C++ compiler found (set CXX, or install g++)"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
        except OSError as e:
            return None, f"cannot write to {target.parent} ({e.strerror}); set ZERO_CACHE_BUILD_DIR"
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{include}", str(_SOURCE), "-o", tmp, f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            return None, f"{compiler} failed to run ({e})"
        if proc.returncode != 0:
            os.unlink(tmp)
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
            return None, f"{compiler} failed: {first}"
        os.replace(tmp, target)  # atomic: another rank building at once renames an identical file
    try:
        helper = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"cannot load {target} ({e})"
    fn = helper.zero_cache_point_storage
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    fn.restype = None
    return fn, None


def _native():
    return _build()[0]


def _native_error() -> str | None:
    return _build()[1]
