"""The training loop: set-up, train_step, periodic logging, evaluation and checkpoints.

``pretrain`` is generic over the model: the entry script (pretrain_gpt.py)
provides the model, the datasets and ``forward_step``, as in Megatron-LM.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.moe.router import update_expert_bias
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.schedules import ForwardStepFunc, forward_backward
from megatron.data import build_pretraining_data_loader
from megatron.tokenizer import build_tokenizer
from megatron.training.activation_offload import TrainerActivationOffload
from megatron.training.attention_backend import attention_backend
from megatron.training.backends import build_backend, build_model
from megatron.training.backends.base import Backend, BackendStepResult
from megatron.training.checkpoint.manager import CheckpointManager
from megatron.training.collective_timeout import CollectiveTimeout
from megatron.training.config import Config, ConfigError
from megatron.training.exit_conditions import ExitConditions, ExitSignal
from megatron.training.heartbeat import Heartbeat
from megatron.training.housekeeping import Housekeeping
from megatron.training.initialize import initialize_distributed, set_random_seed
from megatron.training.lr_scheduler import OptimizerParamScheduler
from megatron.training.run_log import RunLog, summary_line
from megatron.training.stragglers import StragglerDetector
from megatron.training.train_log import TrainLogger


@dataclass
class TrainResult:
    iteration: int
    losses: dict[int, float] = field(default_factory=dict)  # iteration -> DP-averaged lm loss (last stage only)
    lrs: dict[int, float] = field(default_factory=dict)  # iteration -> the learning rate it trained at
    skipped_iterations: list[int] = field(default_factory=list)  # fp16 overflow / non-finite grad norm
    loss_scales: dict[int, float] = field(default_factory=dict)
    offloaded_bytes: dict[int, int] = field(default_factory=dict)  # iteration -> activations moved to host
    model: torch.nn.Module | None = None
    backend: Backend | None = None


def num_samples(cfg: Config) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's formulas; training follows the batch-size schedule)."""
    t, gbs = cfg.train, cfg.parallel.global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_iters > 0 else 0
    return cfg.parallel.schedule.samples_after(t.train_iters), evals * gbs, t.eval_iters * gbs


def _cyclic(loader):
    while True:
        yield from loader


def _average_losses(stats: list[dict], key: str = "lm loss") -> float | None:
    """Mean over micro-batches here, then over data-parallel ranks (last stage only)."""
    if not ps.is_pipeline_last_stage():
        return None
    local = torch.stack([s[key].float() for s in stats]).mean().reshape(1)
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    return local.item() / ps.get_data_parallel_world_size()


def train_step(backend: Backend, forward_step_func: ForwardStepFunc, data_iterator, spec: p2p.TensorSpec,
               num_microbatches: int, lr: float, before_update: Callable[[], None] = lambda: None,
               schedule: str = "1f1b") -> tuple[float | None, BackendStepResult]:
    """One optimizer step; ``before_update`` runs just before the states change (a background save ends);
    ``schedule``: the pipeline schedule's name."""
    backend.zero_grad()
    stats = forward_backward(forward_step_func, data_iterator, backend.model, num_microbatches=num_microbatches,
                             spec=spec, grad_scale_func=backend.scale_loss, passes=backend,
                             schedule=schedule)
    backend.finish_grad_sync()
    before_update()
    result = backend.step(lr)
    return _average_losses(stats), result


def evaluate(backend: Backend, forward_step_func: ForwardStepFunc, data_iterator, spec: p2p.TensorSpec,
             num_microbatches: int, eval_iters: int, schedule: str = "1f1b") -> float | None:
    backend.model.eval()
    losses = []
    with torch.no_grad():
        for _ in range(eval_iters):
            stats = forward_backward(forward_step_func, data_iterator, backend.model,
                                     num_microbatches=num_microbatches, spec=spec, forward_only=True,
                                     schedule=schedule)
            losses.append(_average_losses(stats))
    backend.model.train()
    return sum(losses) / len(losses) if ps.is_pipeline_last_stage() else None


def pretrain(cfg: Config, model_provider: Callable, datasets_provider: Callable,
             forward_step_provider: Callable[..., ForwardStepFunc]) -> TrainResult:
    """Train ``model_provider(model_cfg, rng_tracker)`` on ``datasets_provider(cfg, tokenizer, seq, samples)``,
    one micro-batch at a time through ``forward_step_provider(cfg, tokenizer, device)``."""
    started = time.perf_counter()  # the summary's elapsed time: set-up included
    # First: a SIGTERM / SIGUSR1 during start-up is recorded and ends the run after its first step, saved.
    exit_signal = ExitSignal() if cfg.train.exit_signal_handler else None
    device = initialize_distributed(cfg.parallel)
    heartbeat = Heartbeat()  # lets a rank whose collective timed out name the ranks that went silent
    rng_tracker = set_random_seed(cfg.train.seed, device)
    try:
        tokenizer = build_tokenizer(cfg.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    par = cfg.parallel
    model_cfg = dataclasses.replace(cfg.model.transformer_config(tokenizer.vocab_size, par.tensor_model_parallel_size),
                                    sequence_parallel=par.sequence_parallel, cp_comm_type=par.cp_comm_type)
    # The zero_cache engine keeps fp32 masters itself and casts the compute copies: give it an fp32 model.
    build_cfg = dataclasses.replace(model_cfg, precision="fp32") if cfg.zero_cache is not None else model_cfg
    # Checked before the model is built: a kernel that does not exist here is one line, not a failed first step.
    attention = attention_backend(cfg.model.attention_backend, device, model_cfg.params_dtype,
                                  model_cfg.kv_channels)
    model = build_model(cfg, model_provider, build_cfg, rng_tracker, device)
    backend = build_backend(cfg, model)
    offload = TrainerActivationOffload(model, backend, device) if model_cfg.cpu_offloading_num_layers else None
    scheduler = OptimizerParamScheduler(backend.optimizer, cfg.scheduler)
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    checkpoints = CheckpointManager(cfg.checkpoint, backend, scheduler, rng_tracker,
                                    cfg.to_megatron_args(model_cfg, tokenizer.vocab_size), device, timeout)
    iteration, consumed = checkpoints.load()
    train_timeout = cfg.parallel.train_timeout_seconds
    timeouts = CollectiveTimeout(timeout, datetime.timedelta(seconds=train_timeout) if train_timeout else None)
    if iteration >= cfg.train.train_iters:  # a finished run restarted: its data is used up
        if exit_signal is not None:
            exit_signal.restore()
        if dist.get_rank() == 0:
            print(f"> iteration {iteration} of --train-iters {cfg.train.train_iters} is already trained; nothing to do",
                  flush=True)
        heartbeat.close()
        return TrainResult(iteration=iteration, model=model, backend=backend)

    forward_step_func = forward_step_provider(cfg, tokenizer, device)
    train_ds, valid_ds, _ = datasets_provider(cfg, tokenizer, model_cfg.seq_length, num_samples(cfg))
    t = cfg.train
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    workers = cfg.data.num_workers
    train_iter = iter(build_pretraining_data_loader(train_ds, consumed, par.micro_batch_size, dp_rank, dp_size,
                                                    workers))
    valid_iter = None
    if valid_ds is not None and t.eval_iters > 0:
        valid_consumed = (iteration // t.eval_interval) * t.eval_iters * par.global_batch_size
        valid_iter = _cyclic(build_pretraining_data_loader(valid_ds, valid_consumed, par.micro_batch_size,
                                                           dp_rank, dp_size, workers))

    # What travels between stages: this rank's part of each sequence (1/CP, and 1/TP of that with SP).
    local_seq = model_cfg.seq_length // par.context_parallel_size
    if par.sequence_parallel:
        local_seq //= par.tensor_model_parallel_size
    spec = p2p.TensorSpec((par.micro_batch_size, local_seq, model_cfg.hidden_size), model_cfg.params_dtype, device)
    is_logging_rank = dist.get_rank() == dist.get_world_size() - 1
    run_log = RunLog(cfg.log.log_file, enabled=is_logging_rank)
    logger = TrainLogger(train_iters=t.train_iters, global_batch_size=par.global_batch_size,
                         seq_length=model_cfg.seq_length, flops_per_token=model_cfg.flops_per_token(),
                         world_size=dist.get_world_size(), device=device, tensorboard_dir=t.tensorboard_dir,
                         is_logging_rank=is_logging_rank, log=cfg.log, run_config=dict(cfg.flags), run_log=run_log)
    if is_logging_rank:
        active = (f" ({model_cfg.num_parameters(active=True) / 1e6:.2f}M active per token, "
                  f"EP={par.expert_model_parallel_size})" if model_cfg.moe is not None else "")
        cp = f"CP={par.context_parallel_size} ({par.cp_comm_type}) " if par.context_parallel_size > 1 else ""
        run_log.print(f"> model: {model_cfg.num_parameters() / 1e6:.2f}M parameters{active}, mesh "
                      f"TP={par.tensor_model_parallel_size}{'+SP' if par.sequence_parallel else ''} "
                      f"PP={par.pipeline_model_parallel_size}"
                      f"{f' (v={par.virtual_stages})' if par.virtual_stages > 1 else ''} {cp}"
                      f"DP={par.data_parallel_size}, {par.num_microbatches} "
                      f"micro-batches of {par.micro_batch_size} per step, starting at iteration {iteration}")
        if offload is not None and not offload.moves_anything:
            run_log.print("> --cpu-offloading: no accelerator here (host and device are one memory), activations "
                          "stay where they are")
    ck = cfg.checkpoint
    exits = ExitConditions(signal_handler=exit_signal or False, duration_mins=t.exit_duration_in_mins,
                           save_interval_mins=ck.save_interval_minutes, group=checkpoints.group)
    housekeeping = Housekeeping(cfg.housekeeping, device, dist.get_rank())
    stragglers = StragglerDetector(cfg.stragglers, device) if cfg.stragglers is not None else None
    result = TrainResult(iteration=iteration, model=model, backend=backend)
    first_iteration = iteration + 1  # of this run, for its summary
    routers = model.moe_routers()
    backend.model.train()
    last_grad_norm = None
    saved_at = None  # the iteration of the last save
    step_seconds: list[float] = []  # this rank's step times since the last log line
    with attention:
        while iteration < t.train_iters:
            lr = scheduler.get_lr()
            batch = par.schedule.global_batch_size(consumed)
            housekeeping.before_step(iteration)
            step_started = time.perf_counter()
            loss, step = train_step(backend, forward_step_func, train_iter, spec, par.microbatches(batch), lr,
                                    before_update=checkpoints.wait_before_update, schedule=par.pipeline_schedule)
            if step.update_successful:
                scheduler.step(batch)  # Megatron's schedule counts samples
            update_expert_bias(routers, ps.get_data_parallel_group())
            offload_stats = offload.end_step() if offload is not None else None
            iteration += 1
            consumed += batch
            timeouts.training()
            housekeeping.after_step(iteration)
            result.lrs[iteration] = lr
            step_seconds.append(time.perf_counter() - step_started)
            if offload_stats is not None:
                result.offloaded_bytes[iteration] = offload_stats.offloaded_bytes
            if loss is not None:
                result.losses[iteration] = loss
            if not step.update_successful:
                result.skipped_iterations.append(iteration)
            result.loss_scales[iteration] = step.loss_scale
            logger.record(loss, not step.update_successful, batch)
            last_grad_norm = step.grad_norm if step.grad_norm is not None else last_grad_norm
            if iteration % t.log_interval == 0:
                moe = None if model.moe_stats is None else model.moe_stats.reduce_and_reset(dist.group.WORLD, device)
                logger.log(iteration, consumed, lr, step.loss_scale, last_grad_norm, backend.memory_tiers(),
                           comm=backend.comm_stats(), moe=moe,
                           offload=dataclasses.asdict(offload_stats) if offload and offload.moves_anything else None)
                if stragglers is not None:
                    comm = backend.comm_stats()
                    waited = sum(m.wait_seconds for m in comm.measured.values()) if comm is not None else None
                    for line in stragglers.check(sum(step_seconds) / len(step_seconds), waited):
                        run_log.print(line)
                step_seconds.clear()
            if valid_iter is not None and iteration % t.eval_interval == 0:
                housekeeping.around_eval()
                logger.log_eval(iteration, evaluate(backend, forward_step_func, valid_iter, spec,
                                                    par.num_microbatches, t.eval_iters, par.pipeline_schedule))
                housekeeping.around_eval()
            decision = exits.check(checkpoints.minutes_since_save())
            if ck.save and (decision.save or (ck.save_interval and iteration % ck.save_interval == 0)):
                with timeouts.long():
                    checkpoints.save(iteration, consumed)
                saved_at = iteration
            if checkpoints.snapshot_due(iteration) and not decision.stop and iteration < t.train_iters:
                checkpoints.save_snapshot(iteration, consumed)
            if decision.stop:
                saved = f"after saving it to {ck.save}" if ck.save else "without a checkpoint (no --save)"
                run_log.print(f"> {decision.reason}: stopping at iteration {iteration} {saved}")
                break
            if t.exit_interval and iteration % t.exit_interval == 0:
                break
    with timeouts.long():
        if ck.save and saved_at != iteration:
            checkpoints.save(iteration, consumed)
        backend.finish()
        checkpoints.finish()
    exits.close()
    logger.close()
    housekeeping.close()
    result.iteration = iteration
    if any(not math.isfinite(v) for v in result.losses.values()):
        run_log.print("WARNING: non-finite losses were seen during training")
    # Last, after the final save: also when a signal, the time limit or --exit-interval ended the loop.
    run_log.print(summary_line(first_iteration=first_iteration, last_iteration=iteration,
                               final_loss=logger.last_finite_loss, tokens_per_s=logger.median_tokens_per_s(),
                               elapsed_s=time.perf_counter() - started, checkpoint=ck.save, log_path=run_log.path))
    run_log.close()
    heartbeat.close()
    return result
