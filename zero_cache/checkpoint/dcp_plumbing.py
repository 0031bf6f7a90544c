"""torch.distributed.checkpoint (DCP) plumbing of the distributed checkpoint (``distributed.py``).

The planners that turn ``GlobalTensor`` chunks into DCP write and read items, the writer that streams a
rank's items to its file one at a time, the reader that verifies files before reading them, and the mapping
of DCP's collective failures to one ``CheckpointError``. Imported on the first save or load: DCP and what it
pulls in (DTensor, sympy) cost about a second of start-up that a run which never checkpoints should not pay.
"""
from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import integrity
from .errors import CheckpointError, agreed
from .global_tensor import Chunk, GlobalTensor


class _SavePlanner(DefaultSavePlanner):
    """Writes ``GlobalTensor`` chunks and plain objects; global planning (dedup of identical chunks across
    replicas, metadata, coverage checks) is DCP's."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self._chunk_of: dict[MetadataIndex, Chunk] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, GlobalTensor):
                props = TensorProperties(dtype=obj.dtype)
                for c in obj.chunks:
                    index = MetadataIndex(fqn, torch.Size(c.offsets))
                    self._chunk_of[index] = c
                    items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                        properties=props, size=torch.Size(obj.shape))))
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, GlobalTensor):
            return self._chunk_of[MetadataIndex(write_item.index.fqn, write_item.index.offset)].read()
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return buf


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into ``GlobalTensor`` chunks through their committers and plain objects (``weights_only``)."""

    def __init__(self, optional: set[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.optional = optional
        self.objects: dict[str, Any] = {}
        self.resized: list[str] = []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        self._chunks: dict[tuple[str, int], Chunk] = {}
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if md is None:
                if fqn in self.optional:
                    continue
                raise CheckpointError(f"the checkpoint holds no '{fqn}'")
            if not isinstance(obj, GlobalTensor):
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                      dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(fqn),
                                      storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"'{fqn}' is not a tensor in the checkpoint")
            extent = _check_shape(fqn, tuple(md.size), obj)
            if extent != obj.shape:
                self.resized.append(fqn)
            chunks = []
            for c in obj.chunks:
                sizes = tuple(min(n, max(0, e - o)) for o, n, e in zip(c.offsets, c.sizes, extent))
                if 0 in sizes and len(sizes):
                    continue  # entirely in rows the checkpoint does not have
                self._chunks[(fqn, len(chunks))] = c
                chunks.append(ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(sizes)))
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, map_location="cpu", weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dtype = self.state_dict[read_item.dest_index.fqn].dtype
        return torch.empty(tuple(read_item.lengths), dtype=dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        chunk = self._chunks[(read_item.dest_index.fqn, read_item.dest_index.index)]
        chunk.commit(tuple(read_item.dest_offsets), tuple(read_item.lengths), tensor)


def _check_shape(fqn: str, saved: tuple[int, ...], obj: GlobalTensor) -> tuple[int, ...]:
    """The extent to read: the shapes must agree, except along the tensor's resizable dimension."""
    if saved == obj.shape:
        return saved
    d = obj.resizable_dim
    same_elsewhere = len(saved) == len(obj.shape) and all(
        a == b for i, (a, b) in enumerate(zip(saved, obj.shape)) if i != d)
    if d is None or not same_elsewhere:
        raise CheckpointError(f"'{fqn}' has shape {list(saved)} in the checkpoint but {list(obj.shape)} in this "
                              f"model: they are different models; load it with the model it was saved with "
                              f"(its arguments are stored in the checkpoint)")
    return tuple(min(a, b) for a, b in zip(saved, obj.shape))


class _StreamingWriter(FileSystemWriter):
    """One file per rank, its items written one at a time and dropped once written (torch's writer keeps every
    tensor of a file until the file is done, which would hold a rank's states at once)."""

    def write_data(self, plan: SavePlan, planner: _SavePlanner) -> Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with open(os.path.join(str(self.path), name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    data = data.detach().cpu()
                    if data.untyped_storage().nbytes() != data.nbytes:
                        data = data.clone()  # only the chunk's bytes, not the storage it is a view of
                    torch.save(data, stream)
                del data
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            stream.flush()
            os.fsync(stream.fileno())
        done: Future = Future()
        done.set_result(results)
        return done


class _VerifyingReader(FileSystemReader):
    """Every file this rank's plan reads is checked against checksums.json before anything is read; with
    ``fetch``, the files are first brought to this rank's directory (it is called on every rank)."""

    def __init__(self, path: str, checksums: dict, group, fetch=None):
        super().__init__(path)
        self.checksums, self.group, self.fetch = checksums, group, fetch

    def read_data(self, plan, planner):
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        if self.fetch is not None:
            self.fetch(names)
        # Every rank knows the verdict before any rank reads.
        agreed(lambda: integrity.verify(str(self.path), self.checksums["files"], names), self.group,
               f"another rank found a damaged file in checkpoint '{self.path}'")
        return super().read_data(plan, planner)




def _first_cause(e: CheckpointException) -> BaseException:
    """The most telling failure of a DCP collective: ours (they name the file) before anything else."""
    failures = [exc for exc, _ in e.failures.values()]
    for exc in failures:
        if isinstance(exc, CheckpointError) and "another rank" not in str(exc):
            return exc
    return failures[0] if failures else e


def _run(fn, *args, **kwargs):
    try:
        with warnings.catch_warnings():  # one process saving or loading alone is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return fn(*args, **kwargs)
    except CheckpointException as e:
        cause = _first_cause(e)
        if isinstance(cause, (CheckpointError, OSError)):
            raise cause from None
        raise CheckpointError(f"{type(cause).__name__}: {cause}") from None


def save(state_dict: dict[str, Any], directory: str, group, no_dist: bool) -> None:
    """Write ``state_dict`` (``GlobalTensor`` values and plain objects) into ``directory`` with DCP."""
    writer = _StreamingWriter(directory, single_file_per_rank=True, sync_files=True)
    _run(dcp.save, state_dict, storage_writer=writer, planner=_SavePlanner(), process_group=group, no_dist=no_dist)


def load(state_dict: dict[str, Any], directory: str, checksums: dict, group, optional: set[str],
         no_dist: bool, fetch=None) -> _LoadPlanner:
    """Read ``directory`` into the chunks of ``state_dict``; the planner returned holds the plain objects read
    (``objects``) and the tensors read along their resizable dimension (``resized``)."""
    planner = _LoadPlanner(optional)
    _run(dcp.load, state_dict, storage_reader=_VerifyingReader(directory, checksums, group, fetch), planner=planner,
         process_group=group, no_dist=no_dist)
    return planner


__all__ = ["save", "load", "TensorStorageMetadata"]
