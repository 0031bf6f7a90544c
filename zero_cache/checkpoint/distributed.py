"""The distributed checkpoint: mesh-independent global tensors, written and resharded by torch.distributed.checkpoint.

Every rank declares the pieces of state it holds as chunks of *global* tensors (``geometry.py``): a ZeRO
flat shard becomes the boxes of the parameters it covers, a tensor-parallel slice is placed by its
``GlobalSlice``. ``torch.distributed.checkpoint`` (DCP) writes each rank's chunks in parallel, and on load
plans, for every chunk a rank asks for, which saved chunks overlap it: any tensor-parallel, pipeline,
data-parallel size, ZeRO stage or tier placement reads any checkpoint. Contents (DCP keys):

- ``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``: fp32 parameter values (the optimizer's master
  copy) and Adam's moments, one global tensor each;
- ``tensor/<name>``: replicated tensors that are not trained (buffers, frozen parameters);
- ``obj/<key>``: plain values (``training_state``: Adam's step count and the loss scaler; whatever the caller
  adds: arguments, iteration, scheduler, RNG states), stored with ``torch.save`` and read with
  ``weights_only=True``.

Memory stays bounded both ways: chunks are cut to at most ``slice_numel`` elements and read from their tier
(SSD page files included) one at a time while saving; loading reads one stored chunk at a time and writes
each overlap into its tier (a read-modify-write of the enclosing span where the overlap is not contiguous).

After DCP's files, ``checksums.json`` (``integrity.py``) is written last: it lists every file's size and
CRC-32 and marks the directory complete. Loading verifies the metadata file first and, before any state is
written, every file this rank reads; all ranks agree on the verdict before anyone reads, so a damaged file
fails every rank with one message naming it.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
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
from .geometry import GlobalSlice, flat_boxes, split_box
from .interface import EXP_AVG, EXP_AVG_SQ, PARAM, STATES, StatePiece, StateSource
from .slices import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "zero_cache/dcp-1"
METADATA = ".metadata"
DEFAULT_SLICE_NUMEL = 16 << 20  # 64 MiB of fp32 per stored chunk
UNSLICED = 1 << 62  # chunks as large as the boxes
TRAINING_STATE = "training_state"
Layout = Callable[[str, tuple[int, ...]], GlobalSlice | None]  # (local name, local shape) -> place, None: skip


def whole(name: str, shape: tuple[int, ...]) -> GlobalSlice:
    """The layout of a model that is not tensor- or pipeline-parallel: every local tensor is global."""
    return GlobalSlice.whole(name, shape)


def state_key(state: str, name: str) -> str:
    return f"{state}/{name}"


def object_key(key: str) -> str:
    return f"obj/{key}"


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(out[::-1])


# ---- what one rank writes / reads of a global tensor -------------------------------------------------------
@dataclass
class _Chunk:
    offsets: tuple[int, ...]  # global
    sizes: tuple[int, ...]
    read: Callable[[], torch.Tensor] | None = None  # save: the chunk's values, shaped ``sizes``
    # load: commit(region offsets within the chunk, region lengths, values) writes a region into its state
    commit: Callable[[tuple[int, ...], tuple[int, ...], torch.Tensor], None] | None = None


@dataclass
class _GlobalTensor:
    shape: tuple[int, ...]
    resizable_dim: int | None = None
    dtype: torch.dtype = torch.float32
    chunks: list[_Chunk] = field(default_factory=list)


def _piece_chunks(piece: StatePiece, place: GlobalSlice, slice_numel: int):
    """(box, global offsets) of the boxes of ``piece``, at most ``slice_numel`` elements each."""
    for box in flat_boxes(piece.shape, piece.lo, piece.hi):
        for part in split_box(box, piece.shape, slice_numel):
            yield part, part.shifted(place.offsets)


def _state_committer(source: StateSource, piece: StatePiece, state: str, local_offsets: tuple[int, ...]):
    """commit(region offsets in the chunk, region lengths, values) for a chunk at ``local_offsets`` of
    ``piece``'s parameter: the region is written into the state, contiguous or through its enclosing span."""
    strides = _strides(piece.shape)

    def commit(region: tuple[int, ...], lengths: tuple[int, ...], values: torch.Tensor) -> None:
        start = [o + r for o, r in zip(local_offsets, region)]
        lo = sum(i * s for i, s in zip(start, strides))
        hi = sum((i + n - 1) * s for i, n, s in zip(start, lengths, strides)) + 1
        if hi - lo == values.numel():  # contiguous in the parameter
            source.write_state(piece, state, lo, values.reshape(-1))
            return
        span = source.read_state(piece, state, lo, hi)  # flat, so contiguous
        torch.as_strided(span, lengths, strides).copy_(values)
        source.write_state(piece, state, lo, span)
    return commit


def _tensor_committer(target: torch.Tensor, local_offsets: tuple[int, ...]):
    def commit(region, lengths, values):
        view = target
        for d, (o, r, n) in enumerate(zip(local_offsets, region, lengths)):
            view = view.narrow(d, o + r, n)
        view.copy_(values)
    return commit


def _collect(source: StateSource, layout: Layout, states: tuple[str, ...], slice_numel: int, for_save: bool
             ) -> dict[str, _GlobalTensor]:
    out: dict[str, _GlobalTensor] = {}
    for piece in source.state_pieces():
        place = layout(piece.name, piece.shape)
        if place is None or (for_save and not place.writes):
            continue
        for state in states:
            gt = out.setdefault(state_key(state, place.name), _GlobalTensor(place.global_shape, place.resizable_dim))
            if gt.shape != place.global_shape:
                raise ValueError(f"'{place.name}' is declared with global shapes {gt.shape} and "
                                 f"{place.global_shape}")
            for box, offsets in _piece_chunks(piece, place, slice_numel):
                if for_save:
                    def read(piece=piece, state=state, box=box):
                        return source.read_state(piece, state, box.flat_lo, box.flat_hi).view(box.sizes)
                    gt.chunks.append(_Chunk(offsets, box.sizes, read=read))
                else:
                    gt.chunks.append(_Chunk(offsets, box.sizes,
                                            commit=_state_committer(source, piece, state, box.offsets)))
    for name, tensor in source.replicated_tensors().items():
        shape = tuple(tensor.shape)
        place = layout(name, shape)
        if place is None or (for_save and not place.writes):
            continue
        t = tensor.detach()
        gt = out.setdefault(f"tensor/{place.name}",
                            _GlobalTensor(place.global_shape, place.resizable_dim, t.dtype))
        if for_save:
            gt.chunks.append(_Chunk(place.offsets, shape, read=lambda t=t: t))
        else:
            gt.chunks.append(_Chunk(place.offsets, shape, commit=_tensor_committer(t, (0,) * len(shape))))
    return out


# ---- DCP planners ----------------------------------------------------------------------------------------
class _SavePlanner(DefaultSavePlanner):
    """Writes ``_GlobalTensor`` chunks and plain objects; global planning (dedup of identical chunks across
    replicas, metadata, coverage checks) is DCP's."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self._chunk_of: dict[MetadataIndex, _Chunk] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, _GlobalTensor):
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
        if isinstance(obj, _GlobalTensor):
            return self._chunk_of[MetadataIndex(write_item.index.fqn, write_item.index.offset)].read()
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return buf


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into ``_GlobalTensor`` chunks through their committers and plain objects (``weights_only``)."""

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
        self._chunks: dict[tuple[str, int], _Chunk] = {}
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if md is None:
                if fqn in self.optional:
                    continue
                raise CheckpointError(f"the checkpoint holds no '{fqn}'")
            if not isinstance(obj, _GlobalTensor):
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


def _check_shape(fqn: str, saved: tuple[int, ...], obj: _GlobalTensor) -> tuple[int, ...]:
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
    """Every file this rank's plan reads is checked against checksums.json before anything is read."""

    def __init__(self, path: str, checksums: dict, group):
        super().__init__(path)
        self.checksums, self.group = checksums, group

    def read_data(self, plan, planner):
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        error = None
        try:
            integrity.verify(str(self.path), self.checksums["files"], names)
        except CheckpointError as e:
            error = e
        if dist.is_initialized():  # every rank knows the verdict before any rank reads
            bad = torch.tensor([1 if error else 0])
            dist.all_reduce(bad, group=self.group)
            if bad.item() and error is None:
                error = CheckpointError(f"another rank found a damaged file in checkpoint '{self.path}'")
        if error is not None:
            raise error
        return super().read_data(plan, planner)


# ---- save / load -----------------------------------------------------------------------------------------
def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


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


def save(directory: str, source: StateSource, *, layout: Layout = whole, objects: dict[str, Any] | None = None,
         group=None, slice_numel: int = DEFAULT_SLICE_NUMEL, optimizer: bool = True) -> None:
    """Write a checkpoint of ``source`` into ``directory`` (collective over ``group``; one process: alone).

    objects: plain values to store under ``obj/<key>`` (keys equal on several ranks must hold equal values:
    one copy is kept). optimizer: False leaves Adam's moments out."""
    os.makedirs(directory, exist_ok=True)
    states = STATES if optimizer else (PARAM,)
    state_dict: dict[str, Any] = dict(_collect(source, layout, states, slice_numel, for_save=True))
    for key, value in {TRAINING_STATE: source.training_state(), **(objects or {})}.items():
        state_dict[object_key(key)] = value
    writer = _StreamingWriter(directory, single_file_per_rank=True, sync_files=True)
    _run(dcp.save, state_dict, storage_writer=writer, planner=_SavePlanner(), process_group=group,
         no_dist=not _distributed())
    rank = _group_rank(group)
    mine = integrity.record(directory, sorted(f for f in os.listdir(directory) if f.startswith(f"__{rank}_")))
    everyone = [mine]
    if _distributed():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    if rank == 0:
        entries = {k: v for part in everyone for k, v in part.items()}
        entries.update(integrity.record(directory, [METADATA]))
        integrity.write_checksums(directory, entries, {"format": FORMAT})
    if _distributed():
        dist.barrier(group=group)


def read_index(directory: str) -> dict[str, tuple[int, ...] | None]:
    """{DCP key: global shape, or None for a plain object} of a checkpoint, its metadata file verified."""
    metadata = verified_metadata(directory)
    return {k: (tuple(v.size) if isinstance(v, TensorStorageMetadata) else None)
            for k, v in metadata.state_dict_metadata.items()}


def verified_metadata(directory: str):
    """DCP's metadata of a checkpoint, its file verified against the checksums first."""
    checksums = integrity.read_checksums(directory)
    if checksums.get("format") != FORMAT:
        raise CheckpointError(f"{directory}: format {checksums.get('format')!r}, this version reads {FORMAT!r}")
    integrity.verify(directory, checksums["files"], [METADATA])
    with open(os.path.join(directory, METADATA), "rb") as f:
        return pickle.load(f)  # DCP's own metadata, checksummed above


def load(directory: str, source: StateSource, *, layout: Layout = whole, objects: Iterable[str] = (),
         optional_objects: Iterable[str] = (), optimizer: bool = True, group=None,
         slice_numel: int = DEFAULT_SLICE_NUMEL) -> dict[str, Any]:
    """Read ``directory`` into ``source`` (collective over ``group``), resharding to this rank's pieces.

    Returns the requested plain objects (``optional_objects`` missing from the checkpoint are left out).
    optimizer: False reads parameter values only (fine-tuning, or a checkpoint without optimizer state)."""
    checksums = integrity.read_checksums(directory)
    index = read_index(directory)
    if optimizer and not any(k.startswith(f"{EXP_AVG}/") for k in index):
        raise CheckpointError(f"checkpoint '{directory}' holds no optimizer state (saved without it, or converted "
                              f"from other weights): load it with --finetune or --no-load-optim")
    states = STATES if optimizer else (PARAM,)
    wanted = _collect(source, layout, states, slice_numel, for_save=False)
    # Decided alike on every rank: the parameters of the whole job against the checkpoint's.
    saved_params = {k for k in index if k.startswith(f"{PARAM}/")}
    ours = _all_ranks({k for k in wanted if k.startswith(f"{PARAM}/")}, group)
    missing, extra = sorted(ours - saved_params), sorted(saved_params - ours)
    if missing or extra:
        raise CheckpointError(f"checkpoint '{directory}' does not match this model: it lacks {missing[:5]} and has "
                              f"{extra[:5]} that this model does not; load it with the model arguments it was "
                              f"saved with (stored in the checkpoint)")
    state_dict: dict[str, Any] = dict(wanted)
    keys = [TRAINING_STATE, *objects, *optional_objects]
    for key in keys:
        state_dict[object_key(key)] = None
    planner = _LoadPlanner({object_key(k) for k in optional_objects})
    _run(dcp.load, state_dict, storage_reader=_VerifyingReader(directory, checksums, group), planner=planner,
         process_group=group, no_dist=not _distributed())
    if planner.resized:
        logger.warning("zero_cache checkpoint: %s differ from this model along their resizable dimension (the "
                       "padded vocabulary); the rows both have were loaded, the others keep their initial values",
                       ", ".join(planner.resized[:4]))
    loaded = {k[len("obj/"):]: v for k, v in planner.objects.items()}
    source.load_training_state(loaded.pop(TRAINING_STATE), optimizer)
    source.states_loaded()
    return loaded


def _all_ranks(names: set[str], group) -> set[str]:
    """The union of ``names`` over the ranks of ``group``."""
    if not _distributed():
        return set(names)
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, sorted(names), group=group)
    return {n for p in parts for n in p}


def load_tensor(directory: str, name: str, state: str = PARAM, metadata=None) -> torch.Tensor:
    """One whole global tensor (``state`` of parameter ``name``, or ``tensor`` for a replicated one), read in
    a single process: for tools that stream a checkpoint tensor by tensor."""
    metadata = metadata or verified_metadata(directory)
    key = state_key(state, name)
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint '{directory}' holds no tensor '{key}'")
    out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    gt = _GlobalTensor(tuple(md.size), None, out.dtype, [_Chunk((0,) * out.dim(), tuple(out.shape),
                                                     commit=_tensor_committer(out, (0,) * out.dim()))])
    checksums = integrity.read_checksums(directory)
    _run(dcp.load, {key: gt}, storage_reader=_VerifyingReader(directory, checksums, None),
         planner=_LoadPlanner(set()), no_dist=True)
    return out


def load_objects(directory: str, keys: Iterable[str]) -> dict[str, Any]:
    """Plain objects of a checkpoint, read in a single process."""
    keys = list(keys)
    checksums = integrity.read_checksums(directory)
    planner = _LoadPlanner(set())
    _run(dcp.load, {object_key(k): None for k in keys},
         storage_reader=_VerifyingReader(directory, checksums, None), planner=planner, no_dist=True)
    return {k[len("obj/"):]: v for k, v in planner.objects.items()}


def is_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a complete checkpoint of this format (its checksums file exists)."""
    return os.path.isfile(os.path.join(directory, integrity.CHECKSUMS)) and os.path.isfile(
        os.path.join(directory, METADATA))


__all__ = ["save", "load", "load_tensor", "load_objects", "read_index", "is_checkpoint", "whole", "GlobalSlice",
           "FORMAT", "EXP_AVG", "EXP_AVG_SQ", "PARAM"]
