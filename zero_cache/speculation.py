"""Speculative host update (``zero_optimization.speculative_update``): speculation, then validation.

The host's optimizer work normally starts after the backward. A host sub-group's gradients are final as
soon as the last backward pass of the step has accumulated all of its chunks, and the later layers finish
first, so their sub-groups could be updated while the backward of the earlier layers still runs. What is
not known yet is the global gradient norm: the clip coefficient and the overflow flag. The speculation
assumes neither clips nor overflows: the host lane updates a sub-group with the loss scale alone, after
copying its fp32 master, Adam moments and step count into backup buffers. At the step the engine knows
the norm:

- no overflow, a clip coefficient of exactly 1 and the learning rate the speculation used: the speculative
  update is the update (the step would have called the same kernel on the same values); only the
  write-back to the device is left;
- otherwise every speculated sub-group is restored from its backup, and the step updates it as usual
  (clipping) or skips it (overflow).

So the result is bit-identical to the plain step either way. The speculation uses the learning rate the
optimizer holds during the backward (the last step's, or the config's): a schedule that passes a new rate to
``engine.step(lr)`` every step (the trainer's) makes every speculation a redo. Restores also happen when a speculated
sub-group would change under the speculation: its gradient is accumulated again (a backward pass beyond
the expected ones), or its parameters are read for a gather. A loss scale other than 1 (fp16) is refused
by the config: the fused kernel unscales gradients in place, so a redo would not be exact.

Backups take 12 bytes per element (master, two moments) in host memory, allocated at start-up through the
store under ``memory_budget.host``: the sub-groups the backward finishes first get them, as many as the
budget holds; the others are never speculated.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .chunk import FlatChunk
from .host_lane import HostLane
from .optimizer import ShardedAdam
from .states import State
from .store import HOST, ShardStore


@dataclass(frozen=True)
class SpeculationStats:
    speculated: int  # sub-groups updated during the backward
    accepted: int  # ... whose update stood
    restored: int  # ... restored from their backups (clipping, overflow, or changed under the speculation)

    def __str__(self) -> str:
        return f"speculation {self.speculated} sub-groups, {self.accepted} accepted, {self.restored} restored"


class Speculation:
    def __init__(self, optimizer: ShardedAdam, chunks: list[FlatChunk], sub_groups: list[list[int]],
                 eligible: list[bool], store: ShardStore, lane: HostLane):
        self.opt = optimizer
        self.chunks = chunks
        self.sub_groups = sub_groups
        self.lane = lane
        self.sub_group_of = {i: k for k, sg in enumerate(sub_groups) for i in sg}
        self.backups: dict[int, list[tuple[FlatChunk, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for k in reversed(range(len(sub_groups))):  # the backward finishes the last sub-groups first
            if not eligible[k]:
                continue
            need = sum(12 * chunks[i].plan.shard for i in sub_groups[k])
            room = store.room(HOST)
            if room is not None and need > room:
                break
            self.backups[k] = [(chunks[i],) + tuple(
                store.allocate(f"spec{k}.c{i}.{state.value}", "optimizer", HOST, chunks[i].plan.shard, torch.float32)
                for state in (State.MASTER, State.EXP_AVG, State.EXP_AVG_SQ)) + (torch.zeros((), dtype=torch.float32),)
                for i in sub_groups[k]]
        self.grad_scale = 1.0
        self._lock = threading.Lock()  # the lane speculates and restores; the training thread settles
        self.new_step()
        self._totals = [0, 0, 0]

    @property
    def sub_group_count(self) -> int:
        return len(self.backups)

    def new_step(self) -> None:
        self.final: set[int] = set()  # chunks whose latest accumulation this step was final (host lane)
        self.sent: set[int] = set()  # chunks whose final result the training thread sent to the host
        self.speculated: set[int] = set()
        self.lr_used: dict[int, float] = {}  # the learning rate each speculative update used
        self.tainted: set[int] = set()  # changed under a speculation this step: not speculated again

    # ---- during the backward ------------------------------------------------------------------------
    def chunk_final(self, c: int) -> None:
        """Chunk ``c``'s gradient shard is final (called where it was accumulated: the host lane)."""
        k = self.sub_group_of[c]
        if k not in self.backups or k in self.tainted:
            return
        self.final.add(c)
        if all(i in self.final for i in self.sub_groups[k]):
            self._speculate(k)

    def _speculate(self, k: int) -> None:
        with self._lock:
            for c, master, m, v, step in self.backups[k]:
                master.copy_(c.master)
                m.copy_(c.exp_avg)
                v.copy_(c.exp_avg_sq)
                step.copy_(c.step)
            self.lr_used[k] = self.opt.lr
            self.opt.update_chunks([c for c, *_ in self.backups[k]], self.grad_scale)
            self.speculated.add(k)
            self._totals[0] += 1

    def _restore(self, k: int) -> None:
        with self._lock:
            if k not in self.speculated:
                return
            for c, master, m, v, step in self.backups[k]:
                c.master.copy_(master)
                c.exp_avg.copy_(m)
                c.exp_avg_sq.copy_(v)
                c.step.copy_(step)
            self.speculated.discard(k)
            self._totals[2] += 1

    def chunk_changing(self, c: int) -> None:
        """Host lane: chunk ``c``'s shard is about to be accumulated (again, after a final pass: a pass beyond
        the expected ones restores a speculated sub-group and ends speculation on it for this step)."""
        self.final.discard(c)
        k = self.sub_group_of[c]
        if k in self.speculated:
            self.tainted.add(k)
            self._restore(k)

    def final_sent(self, c: int) -> None:
        """Training thread: chunk ``c``'s final result is on its way to the host lane."""
        self.sent.add(c)

    def revoke(self, c: int) -> None:
        """Training thread: chunk ``c``'s parameters are about to be read (a gather): no speculative update
        may be visible in them. Only a chunk whose gradient is final can be in a speculated sub-group, and in
        a normal step it is not read again before the step."""
        k = self.sub_group_of.get(c)
        if k is None or k not in self.backups or c not in self.sent:
            return
        self.lane.drain()
        self.tainted.add(k)
        self._restore(k)

    # ---- at the step ----------------------------------------------------------------------------------
    def settle(self, accept: bool, lr: float) -> frozenset[int]:
        """After the lane drained: the speculated sub-groups whose update stands (``accept``: no overflow and
        no clipping; and the step's learning rate is the one they used), the others restored."""
        accepted = frozenset(k for k in self.speculated if accept and self.lr_used[k] == lr)
        for k in sorted(self.speculated - accepted):
            self._restore(k)
        self._totals[1] += len(accepted)
        self.new_step()
        return accepted

    def take_stats(self) -> SpeculationStats:
        out = SpeculationStats(*self._totals)
        self._totals = [0, 0, 0]
        return out
