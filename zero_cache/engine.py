"""The ZeRO engine: wraps any ``nn.Module``; forward, hook-driven gradient reduction, sharded step.

Usage::

    engine = zero_cache.initialize(model=model, config="ds_config.json", dp_group=dp_group)
    for micro_batch in step_batches:             # gradient_accumulation_steps of them
        loss = loss_fn(engine(micro_batch))
        engine.backward(loss)                    # or torch.autograd.backward(out, grad) (pipeline stages)
    result = engine.step(lr=lr)                  # StepResult(grad_norm, skipped, loss_scale)
"""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from .builder import ParamInit, build_chunk
from .checkpoint import distributed as dist_ckpt
from .checkpoint import sharded
from .checkpoint.interface import PARAM, StatePiece
from .comm import Comm, CommProfiler, CommStepStats, group_all_reduce
from .comm_theory import zero_step_theory
from .config import ZeroCacheConfig, ZeroConfigError, parse_config
from .coordinator import ParamCoordinator
from .grad_reducer import GradReducer
from .host_lane import HostLane
from .host_memory import set_malloc_for_start_up, set_malloc_for_training
from .loss_scaler import LossScaler
from .optimizer import GroupHParams, ShardedAdam
from .partition import ChunkPlan, FlatChunk, plan_chunks, plan_sub_groups
from .pinned_memory import HostArena
from .placement import copy_staging_units, machine_budgets, place_states
from .speculation import Speculation, SpeculationStats
from .ssd_store import SSDStore
from .store import HOST, NVME, DeviceHostStore, MemoryReport, ShardStore
from .streams import CopyStats, make_streams
from .weight_grad import set_weight_grad_sink

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


class ZeroEngine:
    def __init__(self, model: nn.Module, cfg: ZeroCacheConfig, *, dp_group=None, model_parallel_group=None,
                 param_in_grad_norm: Callable[[nn.Parameter], bool] | None = None,
                 tied_param_groups: Iterable[tuple[nn.Parameter, object]] | None = None,
                 param_groups: list[dict] | None = None, store: ShardStore | None = None,
                 param_init: ParamInit | None = None):
        set_malloc_for_start_up()  # chunk-sized temporaries go back to the OS, not into heap holes
        self.module = model
        self.config = cfg
        self.dp_group = dp_group
        self.model_parallel_group = model_parallel_group
        z = cfg.zero_optimization
        self.profiler = CommProfiler(z.is_communication_time_profiling)
        self.comm = Comm(dp_group, self.profiler, p2p_on_gloo=z.gloo_p2p_collectives)
        self.dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
        managed = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not managed:
            raise ValueError("zero_cache.initialize: the model has no parameters that require grad")
        self.device = managed[0][1].device
        if self.device.type == "meta":
            raise ValueError("zero_cache.initialize: the model is on the meta device; call "
                             "zero_cache.storage_less_parameters(model, device) first and pass param_init")
        hp = cfg.optimizer.params
        self.groups, group_of = _param_groups(managed, param_groups, hp.weight_decay)
        tied = list(tied_param_groups or [])
        self.plans = plan_chunks(managed, group_of, stage=z.stage, page_numel=z.allgather_bucket_size,
                                 dp_size=self.comm.size, persistence_threshold=z.stage3_param_persistence_threshold,
                                 isolated={id(p) for p, _ in tied})
        self.sub_groups = plan_sub_groups(self.plans, z.sub_group_size)
        self.budgets = machine_budgets(cfg, self.device)
        placed = place_states(self.plans, self.sub_groups, cfg, self.dtype, self.device, self.budgets)
        tiers = placed.opt_tiers
        # Host <-> device copies go through copy streams (CUDA, or the emulated accelerator on CPU).
        self.streams = make_streams(cfg, self.device, _global_rank())
        self.streams.configure_staging(*copy_staging_units(self.plans, placed.layouts, cfg, self.device))
        self.comm.streams = self.streams
        pin = z.offload_param.pin_memory or z.offload_optimizer.pin_memory
        pinning = self.streams.pinning
        host_bytes = HostArena.reserve_for([s.nbytes for layout in placed.layouts for s in layout if s.tier == HOST])
        params_on_ssd = z.offload_param.device == "nvme" and z.stage == 3
        if store is None and (NVME in tiers or params_on_ssd):
            path = z.offload_optimizer.nvme_path if NVME in tiers else z.offload_param.nvme_path
            store = SSDStore(self.device, path, cfg.aio, rank=_global_rank(), pin_host=pin,
                             budgets=self.budgets, staging_bytes=placed.opt_staging,
                             param_staging_bytes=placed.param_staging, pinning=pinning,
                             copy_staging=placed.copy_staging, host_bytes=host_bytes)
        self.store = store or DeviceHostStore(self.device, pin_host=pin, budgets=self.budgets, pinning=pinning,
                                              copy_staging=placed.copy_staging, host_bytes=host_bytes)
        with torch.no_grad():
            self.chunks: list[FlatChunk] = [build_chunk(p, tiers[p.index], self.store, self.comm, cfg, self.dtype,
                                                        self.device, param_init, p.index in placed.grad_on_ssd)
                                            for p in self.plans]
        chunk_of = {id(s.param): c.index for c in self.chunks for s in c.plan.slots}
        self._callback_task = None
        self._backward_passes = 0  # this step's (the micro-batches actually run, for the comm theory)
        # The host's share of the work (gradients landing, host sub-groups) runs beside the device's.
        self.lane = HostLane(self.streams.meter) if placed.copy_staging else None
        self.coordinator = None
        if any(not c.plan.resident for c in self.chunks):
            self.coordinator = ParamCoordinator(self.chunks, self.comm, z, self._on_backward_activity, self.store,
                                                self.streams, micro_batches=cfg.gradient_accumulation_steps,
                                                keep_param_bytes=placed.param_keep)
            self.coordinator.register_model(model)
        self.optimizer = ShardedAdam(self.chunks, self.sub_groups, self.groups, lr=hp.lr, betas=hp.betas,
                                     eps=hp.eps, decoupled=cfg.optimizer.decoupled,
                                     pipeline=z.pipeline_optimizer, store=self.store, streams=self.streams,
                                     lane=self.lane)
        tied_chunks = {chunk_of[id(p)] for p, _ in tied}
        self.speculation = None
        if z.speculative_update and self.lane is not None:
            eligible = [all(self.chunks[i].opt_tier == HOST and not self.chunks[i].swapped and i not in tied_chunks
                            for i in sg) for sg in self.sub_groups]
            self.speculation = Speculation(self.optimizer, self.chunks, self.sub_groups, eligible, self.store,
                                           self.lane)
            if self.coordinator is not None:
                self.coordinator.on_issue = self.speculation.revoke
        elif z.speculative_update:
            logger.warning("zero_cache: speculative_update acts only with an accelerator (or the emulated one) and "
                           "optimizer states in host memory; it has no effect here")
        self.reducer = GradReducer(
            self.chunks, self.comm, self.store, mode="full" if z.stage == 1 else "shard",
            max_events=z.max_param_reduce_events, tied_groups={chunk_of[id(p)]: g for p, g in tied},
            on_backward_activity=self._on_backward_activity,
            on_chunk_done=self.coordinator.chunk_done if self.coordinator else None,
            norm_ranges=_norm_ranges(self.chunks, param_in_grad_norm), streams=self.streams, lane=self.lane,
            on_final=self.speculation.chunk_final if self.speculation else None,
            on_change=self.speculation.chunk_changing if self.speculation else None,
            on_final_sent=self.speculation.final_sent if self.speculation else None)
        for c in self.chunks:  # layers that compute their own weight gradient write it into the reduction buffers
            for s in c.plan.slots:
                set_weight_grad_sink(s.param, self.reducer.weight_grad_sink(c.index, s))
        self.last_copy_stats: CopyStats | None = None
        self.last_speculation: SpeculationStats | None = None
        self.scaler = LossScaler(cfg.fp16)
        self._norm_pinned: torch.Tensor | None = None  # the host's part of the norm statistics, on its way over
        self.global_steps = 0
        # Lock-free update: the optimizer step of step t runs here while step t+1 computes.
        self._update_thread = ThreadPoolExecutor(1, "zero_cache_update") if z.lock_free_update else None
        self._pending_update = None
        # Overlapped step: the update runs under the next forward, each gather waiting for its chunk's update.
        self._overlap = (z.overlap_optimizer_step and self._update_thread is None and self.speculation is None
                         and self.optimizer.can_overlap())
        if self._overlap and self.coordinator is not None:
            self.coordinator.update_gate = self.optimizer
        if z.reuse_freed_host_memory:
            set_malloc_for_training()  # each micro-batch's tensors reuse the last one's memory

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

    def _on_backward_activity(self) -> None:
        """Queue one end-of-backward callback per autograd pass, however backward was started."""
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:
            self._join_step()  # the backward accumulates into the gradient shards the update reads
            self._callback_task = task
            # Gradients are final in the pass the step expects to be its last (statistics, speculation).
            self.reducer.final_pass = self._backward_passes + 1 >= self.gradient_accumulation_steps
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if self._update_thread is None:
                self.optimizer.start_read_ahead(during_backward=True)  # SSD states load under the backward

    def _end_backward(self) -> None:
        self._callback_task = None
        self._backward_passes += 1
        self.reducer.end_backward()
        if self.coordinator is not None:
            self.coordinator.release_idle()

    # ---- step -------------------------------------------------------------------------------------------
    def step(self, lr: float | None = None) -> StepResult:
        """Finish gradient reduction, check overflow, clip by the global norm, update the shards."""
        self._join_step()
        if lr is not None:
            self.optimizer.lr = lr
        self.reducer.end_step()
        held_passes = self.reducer.held_passes  # new_step() below starts a new record
        if self.coordinator is not None:
            self.coordinator.end_step()
        if self._update_thread is None:
            self.optimizer.start_read_ahead()  # the first SSD sub-group loads while the norm is computed
        scale = self.scaler.scale
        sq, overflow = self._global_norm_sq_and_overflow()
        grad_norm = math.sqrt(sq) / scale if not overflow else float("inf")
        refreshes = 0  # all-gathers of the resident chunks below, for the communication theory
        clip = self.config.gradient_clipping
        coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 and not overflow else 1.0
        # Speculative updates stand only if the step would have run the same kernel on the same values.
        accepted = (self.speculation.settle(not overflow and coef == 1.0, self.optimizer.lr) if self.speculation
                    else frozenset())
        if not overflow:
            if self._update_thread is None:
                self.optimizer.step(grad_scale=scale / coef, skip=accepted, background=self._overlap)
                self.params_changed()
                refreshes = 1
            else:
                refreshes = int(self._pending_update is not None)  # publish_update gathers only then
                self.publish_update()  # step t-1's update becomes visible to step t+1
                for c in self.chunks:  # step t's gradients are applied in the background
                    c.grad, c.grad_spare = c.grad_spare, c.grad
                self._pending_update = self._update_thread.submit(self.optimizer.step, scale / coef, True)
            self.global_steps += 1
        if overflow:
            self.optimizer.drop_read_ahead()
        self.reducer.new_step()
        self.scaler.update(overflow)
        if overflow:
            logger.warning("zero_cache: gradient overflow, step skipped; loss scale %s -> %s", scale,
                           self.scaler.scale)
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
        self.last_speculation = self.speculation.take_stats() if self.speculation else None
        if self.global_steps % self.config.steps_per_print == 0 and not overflow:
            swap = f"{self.optimizer.last_swap}; " if self.optimizer.last_swap is not None and not self._overlap else ""
            copies = f"{self.last_copy_stats}; " if self.last_copy_stats is not None else ""
            spec = f"{self.last_speculation}; " if self.last_speculation is not None else ""
            logger.info("zero_cache step %d: %s%s%s%s", self.global_steps, swap, copies, spec, self.memory_report())
        return StepResult(grad_norm, overflow, scale, self.optimizer.lr)

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

    def params_changed(self) -> None:
        """The parameter shards changed (update, lock-free publish, checkpoint load): gathered copies of
        partitioned chunks are stale and dropped (the arena caches them); every rank updated its slice of the
        resident chunks, which are all-gathered back into their full buffers."""
        self.optimizer.wait_write_back()  # the compute stream waits for the parameters copied to the device
        if self.coordinator is not None:
            self.coordinator.drop_gathered()
        for c in self.chunks:  # an overlapped step updates these first; partitioned ones are gated
            if c.plan.resident:
                self.optimizer.wait_updated(c.index)
        handles = [self.comm.all_gather(c.full, c.shard_of_full(), tag=f"chunk{c.index}", async_op=True)
                   for c in self.chunks if c.plan.resident]
        for h in handles:
            h.wait()

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
        pool = getattr(self.store, "pool", None)
        if pool is not None:
            report.ssd_cached = self.store.cached_bytes()
            report.swap_buffers_now = pool.in_use - self.store.cached_bytes(pool)
            report.swap_buffers_peak = pool.peak_in_use
        report.budget = dict(self.budgets)
        report.peak_by_tier = dict(report.by_tier)  # shards are allocated once; only staging buffers vary
        if pool is not None:
            report.param_staging_peak = self.store.param_pool.peak_held
            report.peak_by_tier[HOST] = (report.peak_by_tier.get(HOST, 0) + pool.peak_held
                                         + self.store.param_pool.peak_held)
        report.copy_staging = self.streams.staging_bytes  # the pools only grow: held now = peak
        if report.copy_staging:
            report.peak_by_tier[HOST] = report.peak_by_tier.get(HOST, 0) + report.copy_staging
        return report

    def copy_stats(self) -> CopyStats | None:
        """The last step's host <-> device copies: bytes, copy time issued, and the part that blocked compute
        (None without an accelerator or the emulated one)."""
        return self.last_copy_stats

    def swap_stats(self):
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
        """Finish the last step's update wherever it still runs: an overlapped step is waited for (raising
        its error), a pending lock-free update is published. Everything that reads or writes states calls it."""
        self._join_step()
        self.publish_update()

    def _join_step(self) -> None:
        """Wait for an overlapped step, then log its SSD traffic (or the time it held up training) on a print step."""
        if not self.optimizer.in_flight():
            return
        self.optimizer.finish()
        if self.global_steps % self.config.steps_per_print == 0:
            opt = self.optimizer
            what = opt.last_swap if any(opt.swapped) else f"blocked {opt.last_blocked * 1e3:.1f}ms"
            logger.info("zero_cache step %d, update under the next forward: %s", self.global_steps, what)

    @property
    def last_comm_stats(self) -> CommStepStats | None:
        """The last step's collectives next to the ZeRO theory (None unless is_communication_time_profiling)."""
        return self.profiler.last_step

    def _state(self, chunk: FlatChunk, name: str, lo: int, hi: int | None, out: torch.Tensor | None):
        """Elements [lo, hi) of one stored tensor of a chunk (param, master, exp_avg, exp_avg_sq): a view in
        memory (or a copy into ``out``); from SSD a read into ``out`` (else a new host tensor) in aligned pieces."""
        if name == "master" and chunk.master_in_param:
            name = "param"
        if name in chunk.swapped:
            return self.store.read_range(chunk.state_key(name), lo, chunk.plan.shard if hi is None else hi, out)
        t = (chunk.param_shard if name == "param" else getattr(chunk, name))[lo:hi]
        return t if out is None else out.copy_(t)

    def _set_state(self, chunk: FlatChunk, name: str, value: torch.Tensor, lo: int) -> None:
        if name == "master" and chunk.master_in_param:
            name = "param"
        if name in chunk.swapped:
            self.store.write_range(chunk.state_key(name), lo, value)
        else:
            (chunk.param_shard if name == "param" else getattr(chunk, name))[lo:lo + value.numel()].copy_(
                value.reshape(-1))

    def chunk_state(self, chunk: int, state: str, lo: int = 0, hi: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [lo, hi) of this rank's shard of chunk ``chunk``: ``state`` is ``param`` (fp32 values, the
        optimizer's master copy), ``exp_avg`` or ``exp_avg_sq``. A view where the state is in memory (or a copy
        into ``out``); read from SSD into ``out`` (else a new host tensor) in aligned pieces, never whole."""
        self.finish_update()
        return self._state(self.chunks[chunk], "master" if state == PARAM else state, lo, hi, out)

    def set_chunk_state(self, chunk: int, state: str, values: torch.Tensor, lo: int = 0) -> None:
        """Copy ``values`` into elements [lo, lo + values.numel()) of a state, in its tier (done on return);
        ``param`` also updates the compute copy (bf16/fp16, or the device copy of an offloaded master)."""
        self.finish_update()
        c = self.chunks[chunk]
        if state != PARAM:
            self._set_state(c, state, values, lo)
            return
        self._set_state(c, "master", values, lo)
        if not c.master_is_param():
            self._set_state(c, "param", values, lo)

    def publish_update(self) -> None:
        """Lock-free update: wait for the background update and copy its parameters in (no-op otherwise)."""
        if self._pending_update is None:
            return
        future, self._pending_update = self._pending_update, None
        future.result()
        with torch.no_grad():
            for c in self.chunks:
                if "param" in c.swapped:
                    self.store.put(c.state_key("param"), c.pending)
                else:
                    c.param_shard.copy_(c.pending)
        self.params_changed()

    def close(self) -> None:
        """Release the store's files and threads (the SSD tier's swap directory is removed)."""
        try:
            self.finish_update()
        finally:
            for c in self.chunks:
                for s in c.plan.slots:
                    set_weight_grad_sink(s.param, None)
            if self._update_thread is not None:
                self._update_thread.shutdown(wait=True)
            if self.lane is not None:
                self.lane.close()
            self.optimizer.close()
            self.streams.close()
            self.store.close()

    def gather_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Full fp32 state dict (CPU tensors) gathered one chunk at a time; empty on other ranks if rank0_only.

        The result holds the whole model on the receiving rank: for big models use the sharded checkpoint
        and ``python -m zero_cache.checkpoint.consolidate`` instead.
        """
        self.finish_update()
        keep = not rank0_only or self.comm.rank == 0
        aliases = _param_aliases(self.module)
        out: dict[str, torch.Tensor] = {}
        for c in self.chunks:
            full = torch.empty(c.plan.padded, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, self._state(c, "master", 0, None, None).to(self.device), tag=f"export{c.index}")
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

    # ---- checkpoints ------------------------------------------------------------------------------------
    # The engine is a ``zero_cache.checkpoint.interface.StateSource``: the checkpoint code reads and writes
    # states only through the methods below.
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
        self.finish_update()
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
        self.global_steps = int(state["optimizer_step"])  # successful steps: the same count
        self.scaler.load_common_state(state.get("loss_scaler"))
        if state.get("lr") is not None:
            self.optimizer.lr = float(state["lr"])

    # The per-rank layout (checkpoint/sharded.py) works on chunks: interface.ShardedStateSource.
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
        aliases = _param_aliases(self.module)
        return {s.name: aliases[id(s.param)] for c in self.chunks for s in c.plan.slots}

    def slice_numel(self) -> int | None:
        """Elements per checkpoint slice (``save_large_model_slice_size``); None without multi-slice saving."""
        z = self.config.zero_optimization
        return z.save_large_model_slice_size if z.save_large_model_multi_slice else None

    def states_loaded(self) -> None:
        self.params_changed()

    def prepare_checkpoint(self) -> None:
        """Before states are saved or loaded: the last update is finished (``finish_update``) and SSD states
        read ahead of a step are handed back (a load replaces them)."""
        self.finish_update()
        self.optimizer.drop_read_ahead()

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None, *,
                        layout=dist_ckpt.whole, group=None) -> str:
        """Write the distributed checkpoint ``save_dir/tag`` (default ``global_step<N>``), then ``latest``.

        Collective over ``group`` (default: every rank). ``layout(name, shape)`` places each parameter in its
        global tensor (default: as it is; a tensor-parallel model passes its slices). Returns the directory."""
        self.prepare_checkpoint()
        tag = tag or f"global_step{self.global_steps}"
        path = os.path.join(save_dir, tag)
        objects = {"client_state": client_state or {}, "param_aliases": self.param_aliases()}
        dist_ckpt.save(path, self, layout=layout, objects=objects, group=group,
                       slice_numel=self.slice_numel() or dist_ckpt.UNSLICED)
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
        self.prepare_checkpoint()
        if sharded.is_sharded_checkpoint(path):
            return sharded.load(self, load_dir, tag, load_optimizer_states)
        objects = dist_ckpt.load(path, self, layout=layout, objects=["client_state"],
                                 optimizer=load_optimizer_states, group=group,
                                 slice_numel=self.slice_numel() or dist_ckpt.UNSLICED)
        return path, objects["client_state"]

    def save_sharded_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """DeepSpeed's per-rank layout (``zero_pp_rank_*`` files, see checkpoint/sharded.py): every rank writes
        its own shards; it loads back only into the same data-parallel size and chunk layout."""
        self.prepare_checkpoint()
        return sharded.save(self, save_dir, tag or f"global_step{self.global_steps}", client_state or {})

    @property
    def dp_rank(self) -> int:
        return self.comm.rank

    @property
    def mp_rank(self) -> int:
        g = self.model_parallel_group
        return dist.get_rank(g) if g is not None and dist.is_initialized() else 0


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _param_groups(managed, param_groups, default_wd) -> tuple[list[GroupHParams], dict[int, int]]:
    if param_groups is None:
        return [GroupHParams(default_wd)], {id(p): 0 for _, p in managed}
    groups, group_of = [], {}
    for g, spec in enumerate(param_groups):
        unknown = set(spec) - {"params", "weight_decay"}
        if unknown or "params" not in spec:
            raise ValueError(f"zero_cache.initialize: param_groups[{g}] must be {{'params': [...], "
                             f"'weight_decay': float}}, got keys {sorted(spec)}")
        groups.append(GroupHParams(float(spec.get("weight_decay", default_wd))))
        for p in spec["params"]:
            if id(p) in group_of:
                raise ValueError(f"zero_cache.initialize: a parameter appears in param_groups {group_of[id(p)]} "
                                 f"and {g}; list each parameter once")
            group_of[id(p)] = g
    missing = [n for n, p in managed if id(p) not in group_of]
    if missing:
        raise ValueError(f"zero_cache.initialize: parameters {missing[:5]} are in no param group; "
                         f"every trainable parameter must be listed")
    return groups, group_of


def _param_aliases(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _norm_ranges(chunks: list[FlatChunk], counts: Callable[[nn.Parameter], bool] | None):
    """Per chunk: None (the whole shard counts in the grad norm) or the shard ranges that count."""
    out = []
    for c in chunks:
        if counts is None or all(counts(s.param) for s in c.plan.slots):
            out.append(None)
        else:
            out.append([(g.shard_lo, g.shard_hi) for g in c.segments if counts(g.slot.param)])
    return out


def initialize(model: nn.Module, config: dict | str | ZeroCacheConfig, dp_group=None, model_parallel_group=None,
               param_in_grad_norm: Callable[[nn.Parameter], bool] | None = None,
               tied_param_groups: Iterable[tuple[nn.Parameter, object]] | None = None,
               param_groups: list[dict] | None = None, param_init: ParamInit | None = None) -> ZeroEngine:
    """Wrap ``model`` (already on its compute device) in a ZeRO engine.

    dp_group: data-parallel group the states are sharded over (default: the world, or none at all).
    model_parallel_group: TPxPP group over which the grad norm and the overflow flag are also reduced.
    param_in_grad_norm(param): whether this rank counts ``param`` in the global norm (skip duplicates).
    tied_param_groups: (param, group) pairs whose gradients are summed across ``group`` before the step.
    param_groups: optional [{'params': [...], 'weight_decay': x}] (default: one group, config's decay).
    param_init(name, param): initial values of parameters without storage (a model too big to build: see
        lazy_init.py); called one chunk at a time so the full model never exists in memory.
    """
    if dp_group is not None and not dist.is_initialized():
        raise ZeroConfigError("zero_cache.initialize: dp_group given but torch.distributed is not initialised")
    dp = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    cfg = parse_config(config, dp)
    return ZeroEngine(model, cfg, dp_group=dp_group, model_parallel_group=model_parallel_group,
                      param_in_grad_norm=param_in_grad_norm, tied_param_groups=tied_param_groups,
                      param_groups=param_groups, param_init=param_init)
