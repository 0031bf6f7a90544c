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

A save is refused before anything is written when a rank's filesystem cannot hold its tensors, and a write
that runs out of space removes this rank's files (``disk_space.py``). The DCP planners, writer and reader are
in ``dcp_plumbing.py``, imported on the first save or load.

After DCP's files, ``checksums.json`` (``integrity.py``) is written last: it lists every file's size and
CRC-32 and marks the directory complete. Loading verifies the metadata file first and, before any state is
written, every file this rank reads; all ranks agree on the verdict before anyone reads, so a damaged file
fails every rank with one message naming it.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from . import disk_space, integrity
from .errors import CheckpointError, agreed
from .geometry import GlobalSlice, flat_boxes, split_box
from .global_tensor import Chunk, GlobalTensor
from .interface import EXP_AVG, EXP_AVG_SQ, PARAM, STATES, StatePiece, StateSource

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
             ) -> dict[str, GlobalTensor]:
    out: dict[str, GlobalTensor] = {}
    for piece in source.state_pieces():
        place = layout(piece.name, piece.shape)
        if place is None or (for_save and not place.writes):
            continue
        for state in states:
            gt = out.setdefault(state_key(state, place.name), GlobalTensor(place.global_shape, place.resizable_dim))
            if gt.shape != place.global_shape:
                raise ValueError(f"'{place.name}' is declared with global shapes {gt.shape} and "
                                 f"{place.global_shape}")
            for box, offsets in _piece_chunks(piece, place, slice_numel):
                if for_save:
                    def read(piece=piece, state=state, box=box):
                        return source.read_state(piece, state, box.flat_lo, box.flat_hi).view(box.sizes)
                    gt.chunks.append(Chunk(offsets, box.sizes, read=read))
                else:
                    gt.chunks.append(Chunk(offsets, box.sizes,
                                           commit=_state_committer(source, piece, state, box.offsets)))
    for name, tensor in source.replicated_tensors().items():
        shape = tuple(tensor.shape)
        place = layout(name, shape)
        if place is None or (for_save and not place.writes):
            continue
        t = tensor.detach()
        gt = out.setdefault(f"tensor/{place.name}",
                            GlobalTensor(place.global_shape, place.resizable_dim, t.dtype))
        if for_save:
            gt.chunks.append(Chunk(place.offsets, shape, read=lambda t=t: t))
        else:
            gt.chunks.append(Chunk(place.offsets, shape, commit=_tensor_committer(t, (0,) * len(shape))))
    return out


# ---- save / load -----------------------------------------------------------------------------------------
def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


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
    rank = _group_rank(group)
    _refuse_if_full(directory, _bytes_to_write(state_dict), group)
    from . import dcp_plumbing
    try:
        dcp_plumbing.save(state_dict, directory, group, no_dist=not _distributed())
    except (OSError, RuntimeError) as e:
        if not disk_space.is_no_space(e):
            raise
        for name in _rank_files(directory, rank) + ([METADATA] if rank == 0 else []):  # every rank removes its own
            if os.path.exists(os.path.join(directory, name)):
                os.remove(os.path.join(directory, name))
        raise disk_space.no_space_error(directory) from None
    mine = integrity.record(directory, _rank_files(directory, rank))
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


def _rank_files(directory: str, rank: int) -> list[str]:
    """The data files DCP's writer names after ``rank`` (``__<rank>_<n>.distcp``), sorted."""
    return sorted(f for f in os.listdir(directory) if f.startswith(f"__{rank}_"))


def _bytes_to_write(state_dict: dict[str, Any]) -> int:
    """The tensor bytes of this rank's chunks (a bound: DCP writes a replicated chunk on one rank only)."""
    total = 0
    for obj in state_dict.values():
        if isinstance(obj, GlobalTensor):
            total += sum(math.prod(c.sizes) for c in obj.chunks) * obj.dtype.itemsize
    return total


def _refuse_if_full(directory: str, needed: int, group) -> None:
    """Every rank refuses the save if one rank's filesystem cannot hold what that rank writes."""
    agreed(lambda: disk_space.check_free(directory, needed), group,
           f"another rank has no space left for its part of checkpoint '{directory}'; nothing was written")


def read_index(directory: str) -> dict[str, tuple[int, ...] | None]:
    """{DCP key: global shape, or None for a plain object} of a checkpoint, its metadata file verified."""
    from .dcp_plumbing import TensorStorageMetadata
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
         slice_numel: int = DEFAULT_SLICE_NUMEL, fetch: Callable[[list[str]], None] | None = None
         ) -> dict[str, Any]:
    """Read ``directory`` into ``source`` (collective over ``group``), resharding to this rank's pieces.

    Returns the requested plain objects (``optional_objects`` missing from the checkpoint are left out).
    optimizer: False reads parameter values only (fine-tuning, or a checkpoint without optimizer state).
    fetch: where ``directory`` is not shared by every rank, called (collectively, once per rank) with the
    data files this rank is about to read, to bring those it lacks (``peer_files.fetch_missing``)."""
    # Agreed before the first collective: where ranks read their own copies (snapshots.py), one may be damaged.
    checksums, index = agreed(lambda: (integrity.read_checksums(directory), read_index(directory)), group,
                              f"another rank found checkpoint '{directory}' damaged; load an earlier iteration")
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
    from . import dcp_plumbing
    planner = dcp_plumbing.load(state_dict, directory, checksums, group, {object_key(k) for k in optional_objects},
                                no_dist=not _distributed(), fetch=fetch)
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
    from . import dcp_plumbing
    metadata = metadata or verified_metadata(directory)
    key = state_key(state, name)
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, dcp_plumbing.TensorStorageMetadata):
        raise CheckpointError(f"checkpoint '{directory}' holds no tensor '{key}'")
    out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    gt = GlobalTensor(tuple(md.size), None, out.dtype, [Chunk((0,) * out.dim(), tuple(out.shape),
                                                     commit=_tensor_committer(out, (0,) * out.dim()))])
    dcp_plumbing.load({key: gt}, directory, integrity.read_checksums(directory), None, set(), no_dist=True)
    return out


def load_objects(directory: str, keys: Iterable[str]) -> dict[str, Any]:
    """Plain objects of a checkpoint, read in a single process."""
    from . import dcp_plumbing
    verified_metadata(directory)  # DCP unpickles the metadata file before it reads any data file
    planner = dcp_plumbing.load({object_key(k): None for k in keys}, directory, integrity.read_checksums(directory),
                                None, set(), no_dist=True)
    return {k[len("obj/"):]: v for k, v in planner.objects.items()}


def is_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a complete checkpoint of this format (its checksums file exists)."""
    return os.path.isfile(os.path.join(directory, integrity.CHECKSUMS)) and os.path.isfile(
        os.path.join(directory, METADATA))


def is_started(directory: str) -> bool:
    """Whether a save of this format wrote into ``directory``, complete or not."""
    try:
        return any(f == METADATA or f.endswith(".distcp") for f in os.listdir(directory))
    except OSError:
        return False


__all__ = ["save", "load", "load_tensor", "load_objects", "read_index", "is_checkpoint", "is_started", "whole",
           "GlobalSlice", "FORMAT", "EXP_AVG", "EXP_AVG_SQ", "PARAM"]
