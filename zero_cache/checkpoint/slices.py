"""Checkpoint slices: a rank's states written as a sequence of bounded files, read back one at a time.

A rank's shards of one state (master, exp_avg, exp_avg_sq) form a *stream*: chunk 0's shard, then chunk
1's, and so on in layout order. Slice ``k`` holds elements ``[k*S, (k+1)*S)`` of the stream of every
state of one kind (S = ``save_large_model_slice_size``):
``<prefix>_<kind>_states.slice<k:05d>.pt`` = ``{"offset": k*S, "<state>": fp32 tensor, ...}``.
Saving fills one slice buffer per state from wherever each shard lives (device, host or SSD page file,
read in aligned pieces) and writes it to a temp name that is then renamed, so host memory is one slice
per state plus one SSD block, all from the store's accounted ``transfer_pool``. The kind's metadata file
lists every slice with its file size and a CRC-32 per state: readers check all sizes before anything is
loaded and each checksum when its file is first opened, and every error names the file.
"""
from __future__ import annotations

import os
import zlib

import torch

from .disk_space import is_no_space, no_space_error
from .errors import CheckpointError


def atomic_torch_save(obj, path: str) -> None:
    """torch.save through a temporary name and a rename; on a full disk the temporary file is removed and
    the error says so."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if is_no_space(e):
            raise no_space_error(path) from None
        raise


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.view(torch.uint8).numpy())


def slice_file(prefix: str, kind: str, k: int) -> str:
    return f"{prefix}_{kind}_states.slice{k:05d}.pt"


def pieces(shards: list[int], lo: int, hi: int):
    """Stream range [lo, hi) as (chunk index, first, end element within its shard, position in the range)."""
    off = 0
    for ci, n in enumerate(shards):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            yield ci, a - off, b - off, a - lo
        off += n
        if off >= hi:
            return


def write_slices(prefix: str, kind: str, states: tuple[str, ...], shards: list[int], slice_size: int, pool,
                 fill) -> dict:
    """Write the streams of ``states`` in slices; ``fill(state, chunk index, lo, hi, out)`` copies elements
    [lo, hi) of that chunk's shard into ``out``. Returns the index that the kind's metadata file records."""
    total = sum(shards)
    bufs = {s: pool.acquire(4 * min(slice_size, total)) for s in states}
    files = []
    try:
        for k, lo in enumerate(range(0, total, slice_size)):
            hi = min(total, lo + slice_size)
            data = {"offset": lo}
            for s in states:
                t = bufs[s].view(torch.float32, hi - lo)
                for ci, a, b, pos in pieces(shards, lo, hi):
                    fill(s, ci, a, b, t[pos:pos + b - a])
                data[s] = t
            path = slice_file(prefix, kind, k)
            atomic_torch_save(data, path)
            files.append({"file": os.path.basename(path), "bytes": os.path.getsize(path),
                          "crc32": {s: crc32(data[s]) for s in states}})
    finally:
        for buf in bufs.values():
            pool.release(buf)
    return {"slice_size": slice_size, "numel": total, "states": list(states), "files": files}


class SliceFiles:
    """The slice files of one rank and kind, as its metadata file ``owner`` lists them."""

    def __init__(self, tag_dir: str, owner: str, index: dict):
        self.tag_dir, self.owner, self.index = tag_dir, owner, index
        self.size, self.numel = index["slice_size"], index["numel"]
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return len(self.index["files"])

    def path(self, k: int) -> str:
        return os.path.join(self.tag_dir, self.index["files"][k]["file"])

    def check_present(self) -> None:
        """Every slice exists with the size it was written with (before anything is loaded)."""
        for k, entry in enumerate(self.index["files"]):
            path = self.path(k)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing (slice {k} of {len(self)} listed in {self.owner}): the "
                                      f"checkpoint is incomplete; load an earlier tag")
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                raise CheckpointError(f"{path} is truncated or was overwritten: {size} bytes, {entry['bytes']} "
                                      f"written (slice {k} listed in {self.owner}); load an earlier tag")

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.size, min(self.numel, (k + 1) * self.size)

    def load(self, k: int) -> dict[str, torch.Tensor]:
        """Slice ``k``'s tensors, memory-mapped; offset, sizes and (on first open) checksums verified."""
        path, entry = self.path(k), self.index["files"][k]
        lo, hi = self.bounds(k)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (slice {k} listed in {self.owner}); load an earlier "
                                  f"tag") from None
        except Exception as e:  # torch reports a damaged zip archive in several ways
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); the slice is truncated or "
                                  f"corrupted: load an earlier tag") from None
        for s in self.index["states"]:
            t = data.get(s) if isinstance(data, dict) else None
            if not isinstance(t, torch.Tensor) or data.get("offset") != lo or t.dtype != torch.float32 \
                    or t.numel() != hi - lo:
                raise CheckpointError(f"{path} does not hold elements [{lo}, {hi}) of '{s}' as {self.owner} "
                                      f"lists them: it is corrupted or belongs to another save")
            if k not in self._verified and crc32(t) != entry["crc32"][s]:
                raise CheckpointError(f"{path} is corrupted: CRC-32 of '{s}' is {crc32(t):#010x}, "
                                      f"{entry['crc32'][s]:#010x} was written; load an earlier tag")
        self._verified.add(k)
        return data

    def locate(self, lo: int, hi: int):
        """Stream range [lo, hi) as (slice, first, end element within it, position in the range)."""
        for k in range(lo // self.size, (hi - 1) // self.size + 1):
            a, b = self.bounds(k)
            yield k, max(lo, a) - a, min(hi, b) - a, max(lo, a) - lo
