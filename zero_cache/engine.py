"""The ZeRO engine: wraps any ``nn.Module``; forward, hook-driven gradient reduction, sharded step.

Usage::

    engine = zero_cache.initialize(model=model, config="ds_config.json", dp_group=dp_group)
    for micro_batch in step_batches:             # gradient_accumulation_steps of them
        loss = loss_fn(engine(micro_batch))
        engine.backward(loss)                    # or torch.autograd.backward(out, grad) (pipeline stages)
    result = engine.step(lr=lr)                  # StepResult(grad_norm, skipped, loss_scale)

The engine runs parts that builder.py makes (docs/zero_cache/design.md): the coordinator gathers, the reducer
reduces, the update strategy updates; it hears the start of each backward pass through the chunk lifecycle
(lifecycle.py) and owns the step's order: finish the reduction, the global norm, then update or skip.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .builder import EngineParts, build_engine_parts
from .checkpoint import distributed as dist_ckpt
from .checkpoint import sharded
from .checkpoint.names import default_tag
from .chunk_init import ParamInit
from .comm import CommStepStats, group_all_reduce
from .comm_theory import zero_step_theory
from .config import ZeroCacheConfig, ZeroConfigError, parse_config
from .grad_reducer import DeferredWrite
from .lifecycle import ChunkListener
from .optimizer import SwapStats
from .speculation import SpeculationStats
from .store import HOST, MemoryReport
from .streams import CopyStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global, unscaled, before clipping (inf/nan when the step overflowed)
    skipped: bool  # True when non-finite gradients skipped the update
    loss_scale: float  # scale that applied to this step's gradients
    lr: float

    @property
    def update_successful(self) -> bool:
        return not self.skipped


class ZeroEngine(ChunkListener):
    def __init__(self, parts: EngineParts):
        self.module = parts.module
        self.config = parts.config
        self.dtype = parts.dtype
        self.device = parts.device
        self.comm = parts.comm
        self.model_parallel_group = parts.model_parallel_group
        self.profiler = parts.profiler
        self.plans = parts.plans
        self.sub_groups = parts.sub_groups
        self.budgets = parts.budgets
        self.streams = parts.streams
        self.store = parts.store
        self.chunks = parts.chunks
        self.lane = parts.lane
        self.events = parts.events
        self.coordinator = parts.coordinator
        self.optimizer = parts.optimizer
        self.update = parts.update
        self.reducer = parts.reducer
        self.scaler = parts.scaler
        self.states = parts.states
        self.steps = parts.steps
        self.events.subscribe(self)  # the start of each backward pass
        self.last_copy_stats: CopyStats | None = None
        self.last_speculation: SpeculationStats | None = None
        self._callback_task = None
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary
        self._backward_passes = 0  # this step's (the micro-batches actually run, for the comm theory)
        self._norm_pinned: torch.Tensor | None = None  # the host's part of the norm statistics, on its way over

    # ---- forward / backward ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    @property
    def global_steps(self) -> int:
        """Successful optimizer steps (a checkpoint load restores the count)."""
        return self.steps.value

    @property
    def loss_scale(self) -> float:
        """Factor every backward must carry (pipeline stages receive gradients already multiplied by it)."""
        return self.scaler.scale

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """``loss * loss_scale`` (divided by gradient_accumulation_steps unless told not to), then backward."""
        factor = self.loss_scale / (self.gradient_accumulation_steps if scale_wrt_gas else 1)
        (loss.float() * factor).backward()

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """Declare that ``module``'s forward uses ``param`` owned elsewhere (e.g. a tied output head)."""
        if self.coordinator is not None:
            self.coordinator.add_external(module, param)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Whether the backward passes from now on are the step's last on this rank (its gradients are final
        there, which lets their statistics and the update start early). A pipeline schedule knows; without a
        call (None) the engine takes the gradient_accumulation_steps-th pass of a step for the last."""
        self._boundary = is_boundary

    @contextlib.contextmanager
    def deferred_weight_grads(self) -> Iterator[list[DeferredWrite]]:
        """Backward passes inside compute the input gradients (and the gradients of parameters whose layers
        write none themselves); the weight gradients of the layers that write their own (weight_grad.py) are
        kept in the yielded list, with the tensors they need, for ``backward_weights``: a zero-bubble pipeline
        schedule runs them later, where the pipeline would otherwise idle."""
        writes: list[DeferredWrite] = []
        self.reducer.defer_writers(writes)
        try:
            yield writes
        finally:
            self.reducer.defer_writers(None)

    def backward_weights(self, writes: list[DeferredWrite]) -> None:
        """The weight pass of a split backward (``deferred_weight_grads``): a backward pass of its own, whose
        gradients are reduced like any other's (it is the step's last under ``set_gradient_accumulation_boundary``
        (True))."""
        self._start_pass()
        with torch.no_grad():  # as inside autograd's backward: the kept inputs require grad
            self.reducer.write_deferred(writes)
        self._finish_pass()

    def backward_touched(self) -> None:
        """Lifecycle: queue one end-of-backward callback per autograd pass, however backward was started."""
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:
            self._callback_task = task
            self._start_pass()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _start_pass(self) -> None:
        self._join_update()  # the backward accumulates into the gradient shards the update reads
        # Gradients are final in the step's last pass (statistics, speculation).
        last = self._boundary
        if last is None:
            last = self._backward_passes + 1 >= self.gradient_accumulation_steps
        self.reducer.start_pass(final=last)
        self.update.backward_started()

    def _end_backward(self) -> None:
        self._callback_task = None
        self._backward_passes += 1
        self._finish_pass()

    def _finish_pass(self) -> None:
        self.reducer.end_backward()
        if self.coordinator is not None:
            self.coordinator.release_idle()

    # ---- step -------------------------------------------------------------------------------------------
    def step(self, lr: float | None = None) -> StepResult:
        """Finish gradient reduction, check overflow, clip by the global norm, update the shards."""
        self._join_update()
        if lr is not None:
            self.optimizer.lr = lr
        self.reducer.end_step()
        held_passes = self.reducer.held_passes  # new_step() below starts a new record
        if self.coordinator is not None:
            self.coordinator.end_step()
        self.update.prepare()
        scale = self.scaler.scale
        sq, overflow = self._global_norm_sq_and_overflow()
        grad_norm = math.sqrt(sq) / scale if not overflow else float("inf")
        refreshes = 0  # all-gathers of the resident chunks, for the communication theory
        if overflow:
            self.update.skip()
        else:
            clip = self.config.gradient_clipping
            coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
            refreshes = self.update.apply(scale / coef, unclipped=coef == 1.0)
            self.steps.value += 1
        self.reducer.new_step()
        self.scaler.update(overflow)
        if overflow:
            logger.warning("zero_cache: gradient overflow, step skipped; loss scale %s -> %s", scale,
                           self.scaler.scale)
        self._log_step(overflow, refreshes, held_passes)
        return StepResult(grad_norm, overflow, scale, self.optimizer.lr)

    def _log_step(self, overflow: bool, refreshes: int, held_passes: dict[int, int]) -> None:
        if self.profiler.enabled:
            comm = self.profiler.end_step(zero_step_theory(
                self.plans, stage=self.config.zero_optimization.stage, element_size=self.dtype.itemsize,
                dp_size=self.comm.size, micro_batches=self._backward_passes, param_updates=refreshes,
                held_passes=held_passes))
            if self.global_steps % self.config.steps_per_print == 0 or overflow:
                logger.info("zero_cache comm step %d: %s", self.global_steps, comm.line())
                self.profiler.events.clear()  # the ordered trace spans one print interval
        self._backward_passes = 0
        self.last_copy_stats = self.streams.take_stats() if self.streams.separate else None
        self.last_speculation = self.update.take_speculation_stats()
        if self.global_steps % self.config.steps_per_print == 0 and not overflow:
            swapped = self.update.step_swap_stats()
            swap = f"{swapped}; " if swapped is not None else ""
            copies = f"{self.last_copy_stats}; " if self.last_copy_stats is not None else ""
            spec = f"{self.last_speculation}; " if self.last_speculation is not None else ""
            logger.info("zero_cache step %d: %s%s%s%s", self.global_steps, swap, copies, spec, self.memory_report())

    def _global_norm_sq_and_overflow(self) -> tuple[float, bool]:
        """The step's one read of a device value on the host: [sum of squares, non-finite count] of every
        gradient shard, reduced over the groups (clipping, the skip decision and the loss scale need it)."""
        host, stats = self.reducer.norm_stats_parts()
        if stats is None:
            stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        if host is not None:
            if self.device.type == "cpu":
                stats = stats + host
            else:  # one asynchronous copy from pinned memory, not one blocking copy per shard
                if self._norm_pinned is None:
                    self._norm_pinned = torch.empty(2, dtype=torch.float64, pin_memory=True)
                stats = stats + self._norm_pinned.copy_(host).to(self.device, non_blocking=True)
        self.comm.all_reduce(stats, tag="grad_norm")
        group_all_reduce(stats, self.model_parallel_group)
        sq, bad = stats.tolist()
        return sq, bool(bad > 0 or not math.isfinite(sq))

    # ---- reporting / export ---------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        report = MemoryReport()
        for (kind, tier), n in self.store.nbytes().items():
            report.by_kind[kind] = report.by_kind.get(kind, 0) + n
            report.by_tier[tier] = report.by_tier.get(tier, 0) + n
            report.by_kind_tier[(kind, tier)] = n
        if self.coordinator is not None:
            report.gathered_now = self.coordinator.gathered_bytes
            report.gathered_peak = self.coordinator.gathered_peak
            if self.coordinator.arena is not None:
                report.gathered_reserved = self.coordinator.arena.nbytes
        report.budget = dict(self.budgets)
        report.peak_by_tier = dict(report.by_tier)  # shards are allocated once; only staging buffers vary
        self.store.report_staging(report)
        report.copy_staging = self.streams.staging_bytes  # the pools only grow: held now = peak
        if report.copy_staging:
            report.peak_by_tier[HOST] = report.peak_by_tier.get(HOST, 0) + report.copy_staging
        return report

    def copy_stats(self) -> CopyStats | None:
        """The last step's host <-> device copies: bytes, copy time issued, and the part that blocked compute
        (None without an accelerator or the emulated one)."""
        return self.last_copy_stats

    def swap_stats(self) -> SwapStats | None:
        """SSD traffic and measured overlap of the last optimizer step (None without SSD-tier states); an
        overlapped step is finished first, and its blocked time is the time the forward waited for it."""
        self.finish_update()
        return self.optimizer.last_swap

    def synchronize_writes(self) -> None:
        """Finish the last step's update and wait for the SSD writes it left in flight (they otherwise finish
        under the next forward, and any read of a shard waits for its own write); a failed write raises here."""
        self.finish_update()
        self.store.synchronize_writes()

    def finish_update(self) -> None:
        """Finish the last step's update wherever it still runs (an overlapped walk is joined, raising its
        error; a lock-free update is published). Everything that reads or writes states calls it."""
        self._join_update()
        self.update.finish()

    def _join_update(self) -> None:
        """Join an update still running under this step's compute; log what it did on a print step."""
        done = self.update.join()
        if done is not None and self.global_steps % self.config.steps_per_print == 0:
            logger.info("zero_cache step %d, update under the next forward: %s", self.global_steps, done)

    @property
    def last_comm_stats(self) -> CommStepStats | None:
        """The last step's collectives next to the ZeRO theory (None unless is_communication_time_profiling)."""
        return self.profiler.last_step

    def close(self) -> None:
        """Release the store's files and threads (the SSD tier's swap directory is removed)."""
        try:
            self.finish_update()
        finally:
            self.reducer.close()
            self.update.close()
            if self.lane is not None:
                self.lane.close()
            self.optimizer.close()
            self.streams.close()
            self.store.close()

    def gather_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Full fp32 state dict (CPU tensors) gathered one chunk at a time; empty on other ranks if rank0_only
        (``ShardStates.gather_state_dict``)."""
        return self.states.gather_state_dict(rank0_only)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None, *,
                        layout=dist_ckpt.whole, group=None) -> str:
        """Write the distributed checkpoint ``save_dir/tag`` (default ``global_step<N>``), then ``latest``.

        Collective over ``group`` (default: every rank). ``layout(name, shape)`` places each parameter in its
        global tensor (default: as it is; a tensor-parallel model passes its slices). Returns the directory."""
        self.states.prepare_checkpoint()
        tag = tag or default_tag(self.global_steps)
        path = os.path.join(save_dir, tag)
        objects = {"client_state": client_state or {}, "param_aliases": self.states.param_aliases()}
        dist_ckpt.save(path, self.states, layout=layout, objects=objects, group=group,
                       slice_numel=self.states.slice_numel() or dist_ckpt.UNSLICED)
        if _group_rank(group) == 0:
            sharded.write_latest(save_dir, tag)
        if dist.is_initialized():
            dist.barrier(group=group)
        return path

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True, *,
                        layout=dist_ckpt.whole, group=None) -> tuple[str, dict]:
        """Restore ``load_dir/tag`` (default: the tag ``latest`` names) into this engine, whatever mesh and
        placement wrote it; returns (directory, client_state). A checkpoint in the per-rank layout of
        ``save_sharded_checkpoint`` loads into the same data-parallel size and chunk layout only."""
        tag = tag or sharded.latest_tag(load_dir)
        path = os.path.join(load_dir, tag)
        self.states.prepare_checkpoint()
        if sharded.is_sharded_checkpoint(path):
            return sharded.load(self.states, load_dir, tag, load_optimizer_states)
        objects = dist_ckpt.load(path, self.states, layout=layout, objects=["client_state"],
                                 optimizer=load_optimizer_states, group=group,
                                 slice_numel=self.states.slice_numel() or dist_ckpt.UNSLICED)
        return path, objects["client_state"]

    def save_sharded_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """DeepSpeed's per-rank layout (``zero_pp_rank_*`` files, see checkpoint/sharded.py): every rank writes
        its own shards; it loads back only into the same data-parallel size and chunk layout."""
        if any(c.comm is not self.comm for c in self.chunks):
            raise ValueError("zero_cache: the per-rank checkpoint layout holds one data-parallel group, and this "
                             "engine shards some parameters over groups of their own; use save_checkpoint")
        self.states.prepare_checkpoint()
        return sharded.save(self.states, save_dir, tag or default_tag(self.global_steps), client_state or {})

def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def initialize(model: nn.Module, config: dict | str | ZeroCacheConfig, dp_group=None, model_parallel_group=None,
               param_in_grad_norm: Callable[[nn.Parameter], bool] | None = None,
               tied_param_groups: Iterable[tuple[nn.Parameter, object]] | None = None,
               param_groups: list[dict] | None = None, param_init: ParamInit | None = None) -> ZeroEngine:
    """Wrap ``model`` (already on its compute device) in a ZeRO engine.

    dp_group: data-parallel group the states are sharded over (default: the world, or none at all).
    model_parallel_group: TPxPP group over which the grad norm and the overflow flag are also reduced.
    param_in_grad_norm(param): whether this rank counts ``param`` in the global norm (skip duplicates).
    tied_param_groups: (param, group) pairs whose gradients are summed across ``group`` before the step.
    param_groups: optional [{'params': [...], 'weight_decay': x, 'dp_group': g, 'gradient_scaling_factor': f}]
        (default: one group, the config's decay). A group with its own ``dp_group`` (inside ``dp_group``) is
        sharded and reduced over it, its reduced gradient sum multiplied by ``f`` (default 1/size: the mean);
        builder.py says when that is needed (expert parameters).
    param_init(name, param): initial values of parameters without storage (a model too big to build: see
        lazy_init.py); called one chunk at a time so the full model never exists in memory.
    """
    if dp_group is not None and not dist.is_initialized():
        raise ZeroConfigError("zero_cache.initialize: dp_group given but torch.distributed is not initialised")
    dp = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    cfg = parse_config(config, dp)
    return ZeroEngine(build_engine_parts(model, cfg, dp_group=dp_group, model_parallel_group=model_parallel_group,
                                         param_in_grad_norm=param_in_grad_norm, tied_param_groups=tied_param_groups,
                                         param_groups=param_groups, param_init=param_init))
