"""The engine's model states as the checkpoint code and the exports see them: pieces of parameters, wherever
their shards live (device, host memory, SSD), read and written in place, never gathered whole.

``ShardStates`` implements ``checkpoint.interface.ShardedStateSource``: the distributed checkpoint reads and
writes every state through it, and the per-rank layout (``checkpoint/sharded.py``) addresses chunks. Every
access first finishes an update still running (the update strategy's ``finish``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint.interface import PARAM, StatePiece
from .chunk import FlatChunk
from .comm import Comm
from .config import ZeroCacheConfig
from .loss_scaler import LossScaler
from .optimizer import ShardedAdam
from .param_refresh import ParamRefresh
from .partition import ChunkPlan
from .states import State
from .store import ShardStore
from .update import UpdateStrategy


@dataclass
class StepCount:
    """Successful optimizer steps (Adam's step count): the engine counts them, a checkpoint load restores them."""
    value: int = 0


class ShardStates:
    def __init__(self, module: nn.Module, config: ZeroCacheConfig, chunks: list[FlatChunk], store: ShardStore,
                 comm: Comm, model_parallel_group, optimizer: ShardedAdam, scaler: LossScaler, update: UpdateStrategy,
                 refresh: ParamRefresh, steps: StepCount):
        self.module = module
        self.config = config
        self.chunks = chunks
        self.store = store
        self.comm = comm
        self.model_parallel_group = model_parallel_group
        self.dtype = chunks[0].full.dtype  # the compute dtype
        self.device = chunks[0].full.device
        self.optimizer = optimizer
        self.scaler = scaler
        self.update = update
        self.refresh = refresh
        self.steps = steps

    def _state(self, chunk: FlatChunk, state: State, lo: int, hi: int | None, out: torch.Tensor | None):
        """Elements [lo, hi) of one stored tensor of a chunk (param, master, exp_avg, exp_avg_sq): a view in
        memory (or a copy into ``out``); from SSD a read into ``out`` (else a new host tensor) in aligned pieces."""
        state = chunk.home(state)
        if chunk.on_ssd(state):
            return self.store.read_range(chunk.key(state), lo, chunk.plan.shard if hi is None else hi, out)
        t = chunk.tensor(state)[lo:hi]
        return t if out is None else out.copy_(t)

    def _set_state(self, chunk: FlatChunk, state: State, value: torch.Tensor, lo: int) -> None:
        state = chunk.home(state)
        if chunk.on_ssd(state):
            self.store.write_range(chunk.key(state), lo, value)
        else:
            chunk.tensor(state)[lo:lo + value.numel()].copy_(value.reshape(-1))

    def chunk_state(self, chunk: int, state: str, lo: int = 0, hi: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [lo, hi) of this rank's shard of chunk ``chunk``: ``state`` is ``param`` (fp32 values, the
        optimizer's master copy), ``exp_avg`` or ``exp_avg_sq``. A view where the state is in memory (or a copy
        into ``out``); read from SSD into ``out`` (else a new host tensor) in aligned pieces, never whole."""
        self.update.finish()
        return self._state(self.chunks[chunk], State.MASTER if state == PARAM else State(state), lo, hi, out)

    def set_chunk_state(self, chunk: int, state: str, values: torch.Tensor, lo: int = 0) -> None:
        """Copy ``values`` into elements [lo, lo + values.numel()) of a state, in its tier (done on return);
        ``param`` also updates the compute copy (bf16/fp16, or the device copy of an offloaded master)."""
        self.update.finish()
        c = self.chunks[chunk]
        if state != PARAM:
            self._set_state(c, State(state), values, lo)
            return
        self._set_state(c, State.MASTER, values, lo)
        if not c.master_is_param():
            self._set_state(c, State.PARAM, values, lo)

    def gather_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Full fp32 state dict (CPU tensors) gathered one chunk at a time; empty on other ranks if rank0_only.

        The result holds the whole model on the receiving rank: for big models use the sharded checkpoint
        and ``python -m zero_cache.checkpoint.consolidate`` instead.
        """
        self.update.finish()
        keep = not rank0_only or self.comm.rank == 0
        aliases = param_aliases_of(self.module)
        out: dict[str, torch.Tensor] = {}
        for c in self.chunks:
            full = torch.empty(c.plan.padded, dtype=torch.float32, device=self.device)
            c.comm.all_gather(full, self._state(c, State.MASTER, 0, None, None).to(self.device), tag=f"export{c.index}")
            if keep:
                for s in c.plan.slots:
                    t = full[s.offset:s.offset + s.numel].view(s.shape).cpu().clone()
                    for name in aliases[id(s.param)]:
                        out[name] = t
        if keep:
            managed = {id(s.param) for c in self.chunks for s in c.plan.slots}
            for name, p in self.module.named_parameters(remove_duplicate=False):
                if id(p) not in managed:
                    out[name] = p.detach().float().cpu().clone()
            for name, b in self.module.named_buffers():
                out[name] = b.detach().cpu().clone()
        return out

    # ---- checkpoint.interface.StateSource ------------------------------------------------------------------
    def state_pieces(self) -> list[StatePiece]:
        """This rank's shard of every chunk, as flat ranges of the parameters it covers."""
        return [StatePiece(g.slot.name, g.slot.shape, g.param_lo, g.param_lo + g.shard_hi - g.shard_lo,
                           (c.index, g.shard_lo - g.param_lo)) for c in self.chunks for g in c.segments]

    def read_state(self, piece: StatePiece, state: str, lo: int, hi: int) -> torch.Tensor:
        chunk, shift = piece.handle
        return self.chunk_state(chunk, state, lo + shift, hi + shift)

    def write_state(self, piece: StatePiece, state: str, lo: int, values: torch.Tensor) -> None:
        chunk, shift = piece.handle
        self.set_chunk_state(chunk, state, values, lo + shift)

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        managed = {id(s.param) for c in self.chunks for s in c.plan.slots}
        persistent = self.module.state_dict(keep_vars=True)
        return {n: t for n, t in persistent.items() if id(t) not in managed}

    def training_state(self) -> dict:
        self.update.finish()
        steps = {float(c.step) for c in self.chunks}
        if len(steps) != 1:
            raise RuntimeError(f"zero_cache: the chunks disagree on Adam's step count ({sorted(steps)})")
        return {"optimizer_step": int(steps.pop()), "loss_scaler": self.scaler.common_state(),
                "lr": self.optimizer.lr}

    def load_training_state(self, state: dict, load_optimizer: bool) -> None:
        if not load_optimizer:
            return
        for c in self.chunks:
            c.step.fill_(float(state["optimizer_step"]))
        self.steps.value = int(state["optimizer_step"])  # successful steps: the same count
        self.scaler.load_common_state(state.get("loss_scaler"))
        if state.get("lr") is not None:
            self.optimizer.lr = float(state["lr"])

    # ---- checkpoint.interface.ShardedStateSource: the per-rank layout (checkpoint/sharded.py) -----------------
    @property
    def dp_size(self) -> int:
        return self.comm.size

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def transfer_pool(self):
        """Accounted host buffers that checkpoint slices and SSD pieces move through."""
        return self.store.transfer_pool

    def chunk_plans(self) -> list[ChunkPlan]:
        return [c.plan for c in self.chunks]

    def param_aliases(self) -> dict[str, list[str]]:
        """Every name (tied ones too) of each managed parameter, by the name its chunk slot has."""
        aliases = param_aliases_of(self.module)
        return {s.name: aliases[id(s.param)] for c in self.chunks for s in c.plan.slots}

    def slice_numel(self) -> int | None:
        """Elements per checkpoint slice (``save_large_model_slice_size``); None without multi-slice saving."""
        z = self.config.zero_optimization
        return z.save_large_model_slice_size if z.save_large_model_multi_slice else None

    def states_loaded(self) -> None:
        self.refresh.refresh()

    def prepare_checkpoint(self) -> None:
        """Before states are saved or loaded: the last update is finished (``ZeroEngine.finish_update``) and SSD states
        read ahead of a step are handed back (a load replaces them)."""
        self.update.finish()
        self.optimizer.drop_read_ahead()

    @property
    def dp_rank(self) -> int:
        return self.comm.rank

    @property
    def mp_rank(self) -> int:
        g = self.model_parallel_group
        return dist.get_rank(g) if g is not None and dist.is_initialized() else 0


def param_aliases_of(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``model`` (tied parameters have several), by id."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out
