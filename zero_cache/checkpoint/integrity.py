"""Checksums of checkpoint files: recorded when written, verified before they are read.

A checkpoint directory's ``checksums.json`` lists every file with its size and CRC-32. It is written last
(atomically), so its presence also marks the directory complete. A file that is missing, of another size or
with another CRC-32 is a ``CheckpointError`` naming it and what to do.
"""
from __future__ import annotations

import json
import os
import zlib

from .errors import CheckpointError

CHECKSUMS = "checksums.json"
_BLOCK = 1 << 20


def file_crc32(path: str) -> tuple[int, int]:
    """(size in bytes, CRC-32) of a file, read through one reused 1 MiB buffer."""
    crc, size = 0, 0
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return size, crc
            crc = zlib.crc32(view[:n], crc)
            size += n


def record(directory: str, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "crc32"}} of files in ``directory``."""
    out = {}
    for name in names:
        size, crc = file_crc32(os.path.join(directory, name))
        out[name] = {"bytes": size, "crc32": crc}
    return out


def write_checksums(directory: str, entries: dict[str, dict], extra: dict | None = None) -> None:
    """Write ``checksums.json`` atomically (fsynced): from now on the directory counts as complete."""
    path = os.path.join(directory, CHECKSUMS)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({**(extra or {}), "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_checksums(directory: str) -> dict:
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: checkpoint '{directory}' is incomplete (its save did not "
                              f"finish); load an earlier iteration")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data["files"].items()
    except (ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path} is damaged ({e}); load an earlier iteration") from None
    return data


def verify(directory: str, entries: dict[str, dict], names) -> None:
    """Check that each named file exists with the recorded size and CRC-32."""
    for name in names:
        path = os.path.join(directory, name)
        want = entries.get(name)
        if want is None:
            raise CheckpointError(f"{path} is not listed in {os.path.join(directory, CHECKSUMS)}: the checkpoint "
                                  f"was modified after it was written; load an earlier iteration")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing from checkpoint '{directory}'; restore it or load an "
                                  f"earlier iteration")
        size, crc = file_crc32(path)
        if size != want["bytes"]:
            raise CheckpointError(f"{path} is truncated or was overwritten: {size} bytes, {want['bytes']} were "
                                  f"written; load an earlier iteration")
        if crc != want["crc32"]:
            raise CheckpointError(f"{path} is corrupted: CRC-32 {crc:#010x}, {want['crc32']:#010x} was written; "
                                  f"load an earlier iteration")


# A single file's checksum beside it, for the per-rank layouts (each rank writes its own files).
def sidecar_path(path: str) -> str:
    return f"{path}.crc32"


def write_sidecar(path: str) -> None:
    """Record ``path``'s size and CRC-32 in ``<path>.crc32`` (written aside, then renamed)."""
    size, crc = file_crc32(path)
    side = sidecar_path(path)
    tmp = f"{side}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"bytes": size, "crc32": crc}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, side)


def verify_sidecar(path: str) -> bool:
    """Check ``path`` against its sidecar; False when there is none (a file written without one)."""
    side = sidecar_path(path)
    if not os.path.isfile(side):
        return False
    try:
        with open(side, encoding="utf-8") as f:
            want = json.load(f)
        entries = {os.path.basename(path): {"bytes": int(want["bytes"]), "crc32": int(want["crc32"])}}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{side} is damaged ({e}); load an earlier iteration") from None
    verify(os.path.dirname(path) or ".", entries, [os.path.basename(path)])
    return True
