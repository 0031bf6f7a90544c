"""DeepSpeed-style JSON config, parsed once into typed dataclasses.

Every block is a dataclass whose field names are the JSON keys, and every field carries its documentation
in its metadata (``key(...)``): meaning, numeric range or allowed values, and whether it acts in this
engine. ``python -m zero_cache.config_docs`` renders that as ``docs/zero_cache/config.md``.

Parsing is strict: an unknown key is an error that names it and suggests the nearest valid key (DeepSpeed
silently ignores typos, a known trap); wrong types and out-of-range values are errors too. Keys that
DeepSpeed defines but this engine has no use for are accepted (so DeepSpeed configs load) and, when a JSON
sets any of them, named in one warning. The batch-size triple is resolved against the data-parallel size
exactly as DeepSpeed does.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DOC_PATH = "docs/zero_cache/config.md"


class ZeroConfigError(ValueError):
    """A zero_cache config problem; the message names the key and the fix."""


def _check(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise ZeroConfigError(f"zero_cache config: '{path}' {msg}")


def key(doc: str, *, lo=None, hi=None, choices=None, acts: bool = True) -> dict:
    """Field metadata of one JSON key: ``doc``, its meaning in this engine (units included); the inclusive
    numeric range ``lo``..``hi`` or the allowed ``choices`` that parsing enforces; ``acts=False`` for a key
    accepted for DeepSpeed compatibility that changes nothing here (setting it logs a warning)."""
    return {"doc": doc, "lo": lo, "hi": hi, "choices": choices, "acts": acts}


def _inert(doc: str, **kw) -> dict:
    return key(doc, acts=False, **kw)


@dataclass
class FP16Config:
    """``fp16``: float16 compute with loss scaling."""
    enabled: bool = field(default=False, metadata=key(
        "Compute in float16: parameters, gathered chunks and chunk gradient buffers are fp16; fp32 master, gradient "
        "shard and Adam moments; the loss is scaled (below). Excludes bf16.enabled."))
    loss_scale: float = field(default=0.0, metadata=key(
        "0: dynamic loss scaling; > 0: this constant scale. Only with fp16.enabled.", lo=0.0))
    initial_scale_power: int = field(default=16, metadata=key(
        "Dynamic scaling starts at a scale of 2**initial_scale_power.", lo=0, hi=64))
    loss_scale_window: int = field(default=1000, metadata=key(
        "Dynamic scaling: the scale doubles after this many steps in a row without overflow.", lo=1))
    hysteresis: int = field(default=2, metadata=key(
        "Dynamic scaling: the scale halves at the hysteresis-th overflow since the count was refilled and at "
        "every overflow after it; the count is refilled when the scale doubles. An overflow step is always "
        "skipped.", lo=1))
    consecutive_hysteresis: bool = field(default=False, metadata=key(
        "Dynamic scaling: true refills the hysteresis count on every step without overflow, so only consecutive "
        "overflows lower the scale."))
    min_loss_scale: float = field(default=1.0, metadata=key(
        "Dynamic scaling never halves the scale below this.", lo=0.0))
    auto_cast: bool = field(default=False, metadata=_inert(
        "DeepSpeed: cast floating-point forward inputs to fp16. Here the engine passes inputs to the module "
        "unchanged; no effect."))


@dataclass
class BF16Config:
    """``bf16``: bfloat16 compute."""
    enabled: bool = field(default=False, metadata=key(
        "Compute in bfloat16: parameters, gathered chunks and chunk gradient buffers are bf16; fp32 master, "
        "gradient shard and Adam moments; no loss scaling. Excludes fp16.enabled."))


@dataclass
class AdamHyperParams:
    """``optimizer.params``: the hyperparameters of the sharded Adam."""
    lr: float = field(default=1e-3, metadata=key(
        "Learning rate, until engine.step(lr=...) sets another.", lo=0.0))
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=key(
        "[beta1, beta2]: decay rates of the first and second moment, each in [0, 1)."))
    eps: float = field(default=1e-8, metadata=key(
        "Added to the square root of the second moment in the denominator.", lo=0.0))
    weight_decay: float = field(default=0.0, metadata=key(
        "Weight decay of the default parameter group; param_groups passed to zero_cache.initialize set their "
        "own.", lo=0.0))
    adam_w_mode: bool = field(default=True, metadata=key(
        "For type Adam (DeepSpeed's rule): true decays the weights decoupled from the gradient, as AdamW; false "
        "adds the decay to the gradient (L2). AdamW is always decoupled."))


@dataclass
class AdamConfig:
    """``optimizer``: the only optimizer is Adam, run shard by shard with torch's fused kernel."""
    type: str = field(default="AdamW", metadata=key(
        "AdamW: decoupled weight decay. Adam: the same unless params.adam_w_mode is false, then weight decay "
        "added to the gradient (L2).", choices=("AdamW", "Adam")))
    params: AdamHyperParams = field(default_factory=AdamHyperParams, metadata=key("Adam hyperparameters."))

    @property
    def decoupled(self) -> bool:
        """Weight decay applied to the weights (AdamW), not added to the gradient."""
        return self.type == "AdamW" or self.params.adam_w_mode


@dataclass
class OffloadParamConfig:
    """``zero_optimization.offload_param``: where stage-3 parameter shards live."""
    device: str = field(default="none", metadata=key(
        "Stage 3 only: tier of the partitioned parameter shards (compute dtype): none = the device, cpu = host "
        "memory, nvme = SSD page files read for each gather. In fp32 the shard is also the master copy and lives "
        "with the optimizer states (see the cross-key rules).", choices=("none", "cpu", "nvme")))
    nvme_path: str = field(default="/local_nvme", metadata=key(
        "Directory of the SSD page files when no optimizer state is on SSD (else offload_optimizer.nvme_path is "
        "used; with both on nvme the two must be equal)."))
    pin_memory: bool = field(default=False, metadata=key(
        "Pin host-tier shards (only with an accelerator as compute device); this or offload_optimizer.pin_memory "
        "pins every host-tier shard, carved from one mapping pinned in place. SSD staging buffers are pinned "
        "with an accelerator either way."))
    buffer_count: int = field(default=5, metadata=_inert(
        "DeepSpeed: buffers of the parameter swap pool. Here the staging for parameter shards read from SSD is "
        "sized by stage3_prefetch_bucket_size and the shard sizes, within memory_budget.host; no effect.", lo=1))
    buffer_size: int = field(default=100_000_000, metadata=_inert(
        "DeepSpeed: elements per parameter swap buffer. Here staging buffers are the size of the shards they "
        "hold; no effect.", lo=1))
    max_in_cpu: int = field(default=1_000_000_000, metadata=_inert(
        "DeepSpeed: parameter elements kept in host memory with nvme. Here every parameter shard on nvme is a page "
        "file, read for each gather; no effect.", lo=0))


@dataclass
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where optimizer sub-groups live."""
    device: str = field(default="none", metadata=key(
        "Tier of each sub-group's fp32 master, gradient shard and Adam moments (except the first "
        "prefetch_cache_sub_group_rate share, kept on the device): none = the device; cpu = host memory, the "
        "sub-groups beyond memory_budget.host spilling to SSD; nvme = SSD page files (gradient shards stay in "
        "host memory while it holds them).", choices=("none", "cpu", "nvme")))
    nvme_path: str = field(default="/local_nvme", metadata=key(
        "Directory of the SSD page files (in a per-process subdirectory of zero_cache_swap, removed at close) "
        "whenever optimizer states are on SSD; the free space of its disk sets the default memory_budget.nvme."))
    pin_memory: bool = field(default=False, metadata=key(
        "Pin host-tier shards (only with an accelerator as compute device); this or offload_param.pin_memory "
        "pins every host-tier shard, carved from one mapping pinned in place. SSD staging buffers are pinned "
        "with an accelerator either way."))
    buffer_count: int = field(default=4, metadata=_inert(
        "DeepSpeed: buffers of the optimizer swap pool. Here the staging pool holds the sub-groups in flight "
        "(3 with pipeline_optimizer, else 1) plus the host budget left unused; no effect.", lo=1))
    pipeline_read: bool = field(default=False, metadata=_inert(
        "DeepSpeed: read the next sub-group while the current one updates. Here zero_optimization."
        "pipeline_optimizer does that and the write-back; no effect."))
    pipeline_write: bool = field(default=False, metadata=_inert(
        "DeepSpeed: write the previous sub-group back while the current one updates. Here "
        "zero_optimization.pipeline_optimizer does that and the read-ahead; no effect."))
    fast_init: bool = field(default=False, metadata=_inert(
        "DeepSpeed: fast optimizer initialisation with nvme. Here every state is allocated in its tier and "
        "written once at start-up; no effect."))
    ratio: float = field(default=1.0, metadata=_inert(
        "DeepSpeed: share of the parameters updated on the CPU. Here zero_optimization."
        "prefetch_cache_sub_group_rate sets the share of sub-groups updated on the device; no effect.",
        lo=0.0, hi=1.0))


@dataclass
class AioConfig:
    """``aio``: I/O of the SSD tier's page files."""
    block_size: int = field(default=1_048_576, metadata=key(
        "Bytes per read or write request (os.preadv/pwritev) on a page file, and the buffer checkpoints move SSD "
        "shards through; a multiple of 4096 keeps every request aligned for O_DIRECT.", lo=4096))
    queue_depth: int = field(default=8, metadata=key(
        "Requests outstanding per I/O thread (DeepSpeed's meaning): queue_depth x intra_op_parallelism page-file "
        "jobs run at once (a submitter beyond that waits), each moving its blocks on that many threads.", lo=1))
    intra_op_parallelism: int = field(default=1, metadata=key(
        "I/O threads (DeepSpeed's meaning); multiplies queue_depth, see there.", lo=1))
    single_submit: bool = field(default=False, metadata=_inert(
        "DeepSpeed: submit a job's requests one by one instead of as a batch. Here a job's blocks always move "
        "concurrently; no effect."))
    overlap_events: bool = field(default=True, metadata=_inert(
        "DeepSpeed: submit requests without waiting for earlier ones to complete. Always so here; no effect."))
    use_gds: bool = field(default=False, metadata=_inert(
        "DeepSpeed: NVIDIA GPUDirect Storage. Here page files always move through host buffers; no effect."))


@dataclass
class MemoryBudgetConfig:
    """``zero_optimization.memory_budget``: bytes of model state this process may keep per tier."""
    device: int = field(default=-1, metadata=key(
        "Bytes of model states on the compute device; -1: 90% of the accelerator's free memory, or without one "
        "45% of available host memory split between the LOCAL_WORLD_SIZE ranks of the machine.", lo=-1))
    host: int = field(default=-1, metadata=key(
        "Bytes of model states plus SSD staging buffers in host memory; beyond it optimizer sub-groups (then "
        "gradient shards) move to SSD. -1: 90% of available memory (45% without an accelerator) split between "
        "the LOCAL_WORLD_SIZE ranks.", lo=-1))
    nvme: int = field(default=-1, metadata=key(
        "Bytes of SSD page files; -1: 95% of the free space under offload_optimizer.nvme_path (its nearest "
        "existing parent) split between the LOCAL_WORLD_SIZE ranks.", lo=-1))


@dataclass
class EmulatedAcceleratorConfig:
    """``zero_optimization.emulated_accelerator``: a CPU stand-in for an accelerator, so that the copy
    scheduling a GPU needs runs (and can be caught racing) in CPU tests."""
    enabled: bool = field(default=False, metadata=key(
        "CPU compute only: the device tier becomes a separate memory (its budget memory_budget.device) that host "
        "shards reach only through copies on two emulated copy streams (host to device, device to host), run on "
        "worker threads at the bandwidths below; a copy's destination holds NaN until it lands, so a missing "
        "wait gives wrong numbers. The same code path schedules torch.cuda streams on a GPU."))
    h2d_gbps: float = field(default=16.0, metadata=key(
        "Emulated host-to-device copy bandwidth, GB/s (1e9 bytes per second).", lo=1e-6))
    d2h_gbps: float = field(default=16.0, metadata=key(
        "Emulated device-to-host copy bandwidth, GB/s.", lo=1e-6))
    random_delay_ms: float = field(default=0.0, metadata=key(
        "Each emulated copy also waits a uniformly random 0..random_delay_ms milliseconds (a different stream of "
        "random numbers per rank), so copies land at varying points of the compute.", lo=0.0))


@dataclass
class ZeroOptimizationConfig:
    """``zero_optimization``: the ZeRO stage, chunking, prefetch, offload and memory budgets."""
    stage: int = field(default=3, metadata=key(
        "1: optimizer states and fp32 gradient shards partitioned over the data-parallel group, gradients summed "
        "over the micro-batches in full fp32 buffers and reduce-scattered once per step; 2: gradients "
        "reduce-scattered into the shards every micro-batch; 3: parameters partitioned too, gathered around each "
        "module's forward and backward.", choices=(1, 2, 3)))
    contiguous_gradients: bool = field(default=True, metadata=_inert(
        "DeepSpeed: copy gradients into one contiguous buffer as they are produced. Here every gradient always "
        "goes into its chunk's flat buffer; no effect."))
    overlap_comm: bool = field(default=True, metadata=key(
        "Stages 2 and 3: true runs gradient reduce-scatters asynchronously, up to max_param_reduce_events in "
        "flight while the backward goes on; false waits for each at once (max_param_reduce_events resolves "
        "to 0)."))
    reduce_scatter: bool = field(default=True, metadata=_inert(
        "DeepSpeed: reduce-scatter instead of all-reduce gradients. Here gradients are always reduce-scattered; "
        "no effect."))
    reduce_bucket_size: int = field(default=500_000_000, metadata=_inert(
        "DeepSpeed: elements reduced at a time. Here each chunk (allgather_bucket_size elements) is one "
        "reduce-scatter; no effect.", lo=1))
    allgather_bucket_size: int = field(default=500_000_000, metadata=key(
        "Page size in elements: parameters are packed in order into flat chunks of at most this many elements (a "
        "larger parameter gets a chunk of its own), the unit of sharding, all-gather and reduce-scatter. About "
        "one transformer layer's parameters is a good size.", lo=1))
    sub_group_size: int = field(default=1_000_000_000, metadata=key(
        "Optimizer sub-group size in elements of this rank's shards: consecutive chunks of one parameter group up "
        "to this size (at least one chunk) share a tier and are updated by one fused Adam call; the unit of "
        "offload placement and SSD swapping.", lo=1))
    stage3_prefetch_bucket_size: int = field(default=50_000_000, metadata=key(
        "Stage 3: elements of the chunks being all-gathered ahead of use, in the order the previous step "
        "requested them (chunks already gathered do not count; 0: no prefetch); with offload_param.device nvme "
        "the SSD reads of the next window of as many elements start too.", lo=0))
    stage3_max_live_parameters: int = field(default=1_000_000_000, metadata=key(
        "Stage 3 without max_contigous_params_size: a prefetch that would take the live gathered elements above "
        "this is not issued, and while they are above it no released chunk is kept for reuse; a gather a module "
        "needs now is never refused.", lo=0))
    stage3_max_reuse_distance: int = field(default=1_000_000_000, metadata=key(
        "Stage 3 without max_contigous_params_size: a chunk whose next request comes within this many gathered "
        "elements of requests (by the previous step's order) is kept gathered instead of released.", lo=0))
    stage3_param_persistence_threshold: int = field(default=100_000, metadata=key(
        "Stage 3: parameters of at most this many elements are not partitioned; they stay whole on every rank in "
        "resident chunks, as in stages 1 and 2.", lo=0))
    stage3_gather_16bit_weights_on_model_save: bool = field(default=False, metadata=_inert(
        "DeepSpeed: gather the full 16-bit weights when saving the model. Here save_checkpoint writes shards, and "
        "engine.gather_state_dict() or python -m zero_cache.checkpoint.consolidate build the full weights; no "
        "effect."))
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig, metadata=key(
        "Where stage-3 parameter shards live."))
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig, metadata=key(
        "Where optimizer sub-groups live."))
    pipeline_optimizer: bool = field(default=True, metadata=key(
        "The step walks the sub-groups as a pipeline: the fp32-to-compute-dtype write-back of sub-group i runs "
        "on a worker thread while i+1 updates; on SSD, i+1 is read while i updates and earlier ones are written "
        "back, the last writes finishing under the next forward (staging for 3 sub-groups, more read ahead from "
        "the backward on when the host budget allows). False: one sub-group at a time (staging for 1)."))
    overlap_optimizer_step: bool = field(default=True, metadata=key(
        "With pipeline_optimizer, and sub-groups on SSD or host sub-groups beside an accelerator (or the "
        "emulated one): the step returns once its update has started, and the host's part of the update runs on "
        "a thread of its own in chunk order, under the next forward, whose gather of each chunk first waits for "
        "that chunk's update (and its copy to the device). The same result as waiting for it; no more memory. "
        "Not with lock_free_update or speculative_update."))
    prefetch_cache_sub_group_rate: float = field(default=0.0, metadata=key(
        "With offload_optimizer.device cpu or nvme: share of sub-groups (the first ceil(rate x count)) whose "
        "optimizer states stay and update on the device.", lo=0.0, hi=1.0))
    max_contigous_params_size: int = field(default=-1, metadata=key(
        "Stage 3: elements of one buffer, allocated at start-up, that gathered chunks are placed in and cached in "
        "until the parameters change, evicting idle chunks needed furthest ahead first; it must hold the chunks one "
        "module uses at once (twice that lets the next be prefetched). <= 0: every gather allocates its chunk.",
        lo=-1))
    max_param_reduce_events: int = field(default=1, metadata=key(
        "Stages 2 and 3: gradient reduce-scatters in flight during the backward (0: each is waited for at "
        "once).", lo=0))
    is_communication_time_profiling: bool = field(default=False, metadata=key(
        "Record each collective's kind, bytes and time; every steps_per_print steps (and on overflow) the step's "
        "totals are logged next to the ZeRO theory; engine.last_comm_stats holds the last step's."))
    save_large_model_multi_slice: bool = field(default=True, metadata=key(
        "Checkpoints write and read each state in slice files of save_large_model_slice_size elements, straight "
        "from its tier, so host memory stays bounded; false: one file per kind holding whole flat states."))
    memory_budget: MemoryBudgetConfig = field(default_factory=MemoryBudgetConfig, metadata=key(
        "Bytes of model state this process may keep per tier; placement moves states down the tiers to fit, "
        "and a placement that cannot fit is an error naming bytes and budget."))
    emulated_accelerator: EmulatedAcceleratorConfig = field(default_factory=EmulatedAcceleratorConfig, metadata=key(
        "An emulated accelerator for CPU runs: separate device memory reached by bandwidth-limited asynchronous "
        "copies."))
    speculative_update: bool = field(default=False, metadata=key(
        "With an accelerator (or the emulated one) and offload_optimizer cpu: host sub-groups whose gradients "
        "are final are updated during the last backward of the step, assuming neither clipping nor overflow; "
        "the step checks the global norm and restores and redoes them (clipping) or restores them (overflow). "
        "Exact; costs a copy of master and Adam moments (12 B/element) per speculated sub-group, within "
        "memory_budget.host (sub-groups beyond it are not speculated). Not with lock_free_update or fp16."))
    lock_free_update: bool = field(default=False, metadata=key(
        "Delayed update: step t's optimizer update runs on a background thread while step t+1 computes and is "
        "published at step t+1's step (parameters one step stale). Costs a spare gradient shard and a pending "
        "parameter shard per chunk; needs offload_optimizer.device cpu or nvme."))
    reuse_freed_host_memory: bool = field(default=True, metadata=key(
        "Once the engine is built, the C library (glibc) keeps freed host blocks below 128 MiB in its heap, so "
        "each micro-batch's activations and gradients reuse the last one's memory instead of being page-faulted "
        "in again; the heap then stays near the step's peak and can fragment around tensors that live longer "
        "(recomputation's saved layer inputs). false: blocks of 4 MiB and more are mapped on their own and "
        "returned on free, as during start-up; the memory planner writes false, which its estimates are "
        "measured with."))
    gloo_p2p_collectives: bool = field(default=True, metadata=key(
        "On the gloo backend, all-gathers and reduce-scatters of host tensors run as point-to-point exchanges "
        "without temporaries; false: gloo's own collectives."))
    mics_shard_size: int = field(default=-1, metadata=key(
        "Stage 3, MiCS / HSDP: shard parameters, gradients and optimizer states over groups of this many "
        "consecutive data-parallel ranks (a node, or a few) and replicate them across the groups: gathers stay "
        "inside a group, gradients are reduce-scattered inside it, and the step's shards are all-reduced across "
        "groups once a step. "
        "Must divide the data-parallel size; -1 (or the data-parallel size): one group, plain ZeRO-3.", lo=-1))
    mics_hierarchical_params_gather: bool = field(default=False, metadata=_inert(
        "DeepSpeed MiCS: gather a shard group that spans nodes in two hops. Here a shard group's gather is one "
        "all-gather over the group; no effect (choose mics_shard_size = ranks per node to keep gathers inside a "
        "node)."))
    zero_hpz_partition_size: int = field(default=1, metadata=key(
        "Stage 3, ZeRO++ hpZ: after a chunk's first gather in a step (over the whole data-parallel group), each "
        "rank keeps a secondary shard, 1/this of the chunk, and later gathers of that step (the backward, other "
        "micro-batches) all-gather the secondary shards over groups of this many consecutive data-parallel "
        "ranks (the ranks of a node). Costs padded/size elements per partitioned chunk in the compute dtype. "
        "Must divide the data-parallel size; 1: off.", lo=1))
    zero_quantized_weights: bool = field(default=False, metadata=key(
        "Stage 3, ZeRO++ qwZ: parameter all-gathers send int8 blocks with one fp32 scale per "
        "quantization_block_size elements and dequantize them on arrival (every rank computes with the same "
        "dequantized weights; the fp32 masters are untouched). Secondary-shard gathers (hpZ) and resident "
        "chunks stay exact."))
    zero_quantized_gradients: bool = field(default=False, metadata=key(
        "Stage 3, ZeRO++ qgZ: gradients are reduce-scattered inside each node in full precision, then across "
        "nodes as int8 blocks (an all-to-all, summed in fp32 on arrival). The node is zero_hpz_partition_size "
        "ranks when that is above 1, else the data-parallel ranks torchrun started on this host "
        "(LOCAL_WORLD_SIZE). Not with mics_shard_size."))
    quantized_gradients_error_feedback: bool = field(default=False, metadata=key(
        "With zero_quantized_gradients: each rank keeps what quantizing its node-reduced slice of a chunk lost "
        "(fp32, 4/ranks-per-node bytes per parameter) and adds it to the chunk's next cross-node reduction, so "
        "the rounding error is carried forward instead of lost (error feedback); no effect without "
        "zero_quantized_gradients."))
    quantized_gradients_bits: int = field(default=4, metadata=key(
        "Bits per gradient element in zero_quantized_gradients' cross-node exchange: 4 (ZeRO++'s choice, a quarter "
        "of bf16's bytes) or 8.", choices=(4, 8)))
    zero_quantized_nontrainable_weights: bool = field(default=False, metadata=_inert(
        "DeepSpeed ZeRO++: keep frozen weights quantized. Here only trainable parameters are managed; no "
        "effect."))
    quantization_block_size: int = field(default=256, metadata=key(
        "Elements per quantization block of zero_quantized_weights and zero_quantized_gradients (one fp32 scale "
        "each).", lo=16))
    save_large_model_slice_size: int = field(default=16_777_216, metadata=key(
        "Elements of each state per checkpoint slice file with save_large_model_multi_slice (fp32: 4 bytes each); "
        "bounds the host memory of saving and loading.", lo=1024))


@dataclass
class ZeroCacheConfig:
    """The whole JSON."""
    train_batch_size: int | None = field(default=None, metadata=key(
        "Samples per optimizer step over all data-parallel ranks: train_micro_batch_size_per_gpu x "
        "gradient_accumulation_steps x data-parallel size; null: derived (see Derived values).", lo=1))
    train_micro_batch_size_per_gpu: int | None = field(default=None, metadata=key(
        "Samples per micro-batch per rank; the engine does not load data, the value takes part in batch-size "
        "resolution and is reported resolved. null: derived.", lo=1))
    gradient_accumulation_steps: int | None = field(default=None, metadata=key(
        "Micro-batches per optimizer step; engine.backward divides the loss by it. null: derived.", lo=1))
    gradient_clipping: float = field(default=0.0, metadata=key(
        "Clip gradients by their global L2 norm (over the data-parallel and model-parallel groups) to this "
        "value; 0: no clipping.", lo=0.0))
    steps_per_print: int = field(default=10, metadata=key(
        "Every this many steps log the memory report and SSD traffic (and the collectives with "
        "is_communication_time_profiling).", lo=1))
    wall_clock_breakdown: bool = field(default=False, metadata=_inert(
        "DeepSpeed: log forward, backward and step times. Here no effect; "
        "zero_optimization.is_communication_time_profiling times the collectives."))
    fp16: FP16Config = field(default_factory=FP16Config, metadata=key("float16 compute and loss scaling."))
    bf16: BF16Config = field(default_factory=BF16Config, metadata=key("bfloat16 compute."))
    optimizer: AdamConfig = field(default_factory=AdamConfig, metadata=key("The sharded Adam optimizer."))
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig, metadata=key(
        "ZeRO stage, chunking, prefetch, offload and memory budgets."))
    aio: AioConfig = field(default_factory=AioConfig, metadata=key("I/O of the SSD tier."))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` (JSON scalars only) and return it normalised."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path)
    if tp is bool:
        _check(isinstance(value, bool), path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        _check(ok, path, f"must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), path,
               f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), path, f"must be a string, got {value!r}")
        return value
    if origin is tuple:
        _check(isinstance(value, (list, tuple)) and len(value) == len(args), path,
               f"must be a list of {len(args)} numbers, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    raise TypeError(f"unsupported config annotation {tp} at {path}")


def _build(cls: type, data: Any, path: str, given: list[str]):
    """``cls`` from the JSON object ``data`` at ``path``; appends the path of every key present to ``given``."""
    _check(isinstance(data, dict), path or "<root>", f"must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        full = f"{path}.{name}" if path else name
        if name not in fields:
            near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{(path + '.') if path else ''}{near[0]}'?" if near else \
                f"; valid keys here: {', '.join(sorted(fields))}"
            raise ZeroConfigError(f"zero_cache config: unknown key '{full}'{hint}")
        given.append(full)
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, full, given)
            continue
        value = _coerce(value, tp, full)
        meta = fields[name].metadata
        if value is not None:
            if meta["choices"] is not None:
                _check(value in meta["choices"], full, f"must be one of {list(meta['choices'])}, got {value!r}")
            if meta["lo"] is not None:
                _check(value >= meta["lo"], full, f"must be >= {meta['lo']}, got {value!r}")
            if meta["hi"] is not None:
                _check(value <= meta["hi"], full, f"must be <= {meta['hi']}, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def _resolve_batch(cfg: ZeroCacheConfig, dp: int) -> None:
    """The batch triple is filled so that train_batch_size = micro x steps x dp (micro:
    train_micro_batch_size_per_gpu, steps: gradient_accumulation_steps, dp: the size of the data-parallel group
    the states are sharded over), by DeepSpeed's rules; a mismatch or a division with a remainder is an error
    naming the values.

    - all three given: they must satisfy the equation;
    - train_batch_size and micro: steps = train_batch_size / (micro x dp);
    - train_batch_size and steps: micro = train_batch_size / (steps x dp);
    - train_batch_size alone: micro = train_batch_size / dp, steps = 1;
    - no train_batch_size: a missing micro or steps is 1, and train_batch_size follows."""
    tbs, mbs, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            raise ZeroConfigError(
                f"zero_cache config: train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({mbs})"
                f" * gradient_accumulation_steps ({gas}) * data-parallel size ({dp}) = {mbs * gas * dp}; "
                f"fix one of them or omit one and let it be derived")
    elif tbs is not None and mbs is not None:
        if tbs % (mbs * dp):
            raise ZeroConfigError(
                f"zero_cache config: train_batch_size ({tbs}) is not divisible by train_micro_batch_size_per_gpu"
                f" ({mbs}) * data-parallel size ({dp}); choose sizes that divide")
        gas = tbs // (mbs * dp)
    elif tbs is not None and gas is not None:
        if tbs % (gas * dp):
            raise ZeroConfigError(
                f"zero_cache config: train_batch_size ({tbs}) is not divisible by gradient_accumulation_steps"
                f" ({gas}) * data-parallel size ({dp}); choose sizes that divide")
        mbs = tbs // (gas * dp)
    elif tbs is not None:
        if tbs % dp:
            raise ZeroConfigError(f"zero_cache config: train_batch_size ({tbs}) is not divisible by the "
                                  f"data-parallel size ({dp})")
        mbs, gas = tbs // dp, 1
    else:
        mbs, gas = mbs or 1, gas or 1
    cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = mbs, gas
    cfg.train_batch_size = mbs * gas * dp


def _resolve_overlap(cfg: ZeroCacheConfig, given: list[str] | None) -> None:
    """``zero_optimization.overlap_comm`` false sets ``max_param_reduce_events`` to 0 (every gradient
    reduce-scatter is waited for at once); a JSON that also sets ``max_param_reduce_events`` above 0
    contradicts itself and is an error."""
    z = cfg.zero_optimization
    if z.overlap_comm or z.max_param_reduce_events == 0:
        return
    if given is not None and "zero_optimization.max_param_reduce_events" in given:
        raise ZeroConfigError(
            f"zero_cache config: 'zero_optimization.overlap_comm' is false (no reduction overlaps the backward) "
            f"but 'zero_optimization.max_param_reduce_events' is {z.max_param_reduce_events}; remove one of them "
            f"or set max_param_reduce_events to 0")
    cfg.zero_optimization = dataclasses.replace(z, max_param_reduce_events=0)


def _one_precision(cfg: ZeroCacheConfig) -> None:
    """``fp16.enabled`` and ``bf16.enabled`` are not both true."""
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ZeroConfigError("zero_cache config: 'fp16.enabled' and 'bf16.enabled' are both true; enable at most one")


def _param_offload_needs_stage3(cfg: ZeroCacheConfig) -> None:
    """``zero_optimization.offload_param.device`` other than none needs stage 3 (only stage 3 partitions
    parameters)."""
    z = cfg.zero_optimization
    if z.offload_param.device != "none" and z.stage != 3:
        raise ZeroConfigError("zero_cache config: 'zero_optimization.offload_param' needs stage 3 (parameters are only "
                              f"partitioned in stage 3, got stage {z.stage}); set stage 3 or remove offload_param")


def _fp32_master_follows_optimizer(cfg: ZeroCacheConfig) -> None:
    """In fp32 the parameter shard is the optimizer's master copy: ``zero_optimization.offload_param.device``
    cpu needs ``zero_optimization.offload_optimizer.device`` cpu or nvme, and nvme needs nvme."""
    z = cfg.zero_optimization
    if cfg.fp16.enabled or cfg.bf16.enabled:
        return
    if z.offload_param.device == "cpu" and z.offload_optimizer.device == "none":
        raise ZeroConfigError("zero_cache config: in fp32 the parameter shard is the optimizer's master copy, so "
                              "'offload_param.device' = 'cpu' needs 'offload_optimizer.device' = 'cpu' or 'nvme' too")
    if z.offload_param.device == "nvme" and z.offload_optimizer.device != "nvme":
        raise ZeroConfigError("zero_cache config: in fp32 the parameter shard is the optimizer's master copy, so "
                              "'offload_param.device' = 'nvme' needs 'offload_optimizer.device' = 'nvme' too")


def _one_nvme_path(cfg: ZeroCacheConfig) -> None:
    """With both offload devices nvme, ``zero_optimization.offload_param.nvme_path`` and
    ``zero_optimization.offload_optimizer.nvme_path`` name the same directory."""
    z = cfg.zero_optimization
    if z.offload_param.device == "nvme" and z.offload_optimizer.device == "nvme" and \
            os.path.normpath(z.offload_param.nvme_path) != os.path.normpath(z.offload_optimizer.nvme_path):
        raise ZeroConfigError(f"zero_cache config: 'offload_param.nvme_path' ({z.offload_param.nvme_path}) and "
                              f"'offload_optimizer.nvme_path' ({z.offload_optimizer.nvme_path}) differ; the SSD "
                              f"tier uses one directory per rank, set both to the same path")


def _lock_free_needs_offload(cfg: ZeroCacheConfig) -> None:
    """``zero_optimization.lock_free_update`` needs ``zero_optimization.offload_optimizer.device`` cpu or
    nvme."""
    if cfg.zero_optimization.lock_free_update and cfg.zero_optimization.offload_optimizer.device == "none":
        raise ZeroConfigError("zero_cache config: 'zero_optimization.lock_free_update' overlaps the offloaded "
                              "optimizer step with the next step's compute; it needs 'offload_optimizer.device' = "
                              "'cpu' or 'nvme'")


def _speculation_needs_unit_scale(cfg: ZeroCacheConfig) -> None:
    """``zero_optimization.speculative_update`` excludes ``zero_optimization.lock_free_update`` (whose update
    runs a step late) and ``fp16.enabled`` (the fused kernel unscales gradients in place, so a redo with
    another scale would not be exact)."""
    z = cfg.zero_optimization
    if z.speculative_update and z.lock_free_update:
        raise ZeroConfigError("zero_cache config: 'zero_optimization.speculative_update' and "
                              "'zero_optimization.lock_free_update' exclude each other; enable at most one")
    if z.speculative_update and cfg.fp16.enabled:
        raise ZeroConfigError("zero_cache config: 'zero_optimization.speculative_update' needs a loss scale of 1 "
                              "(fp32 or bf16); fp16's scaled gradients are unscaled in place by the update, so "
                              "a redo would not be exact: disable one of them")


def _hierarchy_needs_stage3(cfg: ZeroCacheConfig) -> None:
    """``zero_optimization.mics_shard_size``, ``zero_hpz_partition_size``, ``zero_quantized_weights`` and
    ``zero_quantized_gradients`` need stage 3; ``mics_shard_size`` excludes ``zero_hpz_partition_size`` and
    ``zero_quantized_gradients`` (a shard group inside a node already keeps gathers there, and its gradients
    cross nodes as an all-reduce of shards)."""
    z = cfg.zero_optimization
    named = [k for k, on in (("mics_shard_size", z.mics_shard_size > 0), ("zero_hpz_partition_size",
             z.zero_hpz_partition_size > 1), ("zero_quantized_weights", z.zero_quantized_weights),
             ("zero_quantized_gradients", z.zero_quantized_gradients)) if on]
    if named and z.stage != 3:
        raise ZeroConfigError(f"zero_cache config: 'zero_optimization.{named[0]}' needs stage 3 (it changes how "
                              f"partitioned parameters are gathered and reduced), got stage {z.stage}; set stage 3 "
                              f"or remove it")
    if z.mics_shard_size > 0 and (z.zero_hpz_partition_size > 1 or z.zero_quantized_gradients):
        other = "zero_hpz_partition_size" if z.zero_hpz_partition_size > 1 else "zero_quantized_gradients"
        raise ZeroConfigError(f"zero_cache config: 'zero_optimization.mics_shard_size' and "
                              f"'zero_optimization.{other}' exclude each other; use shard groups (MiCS/HSDP) or "
                              f"ZeRO++'s secondary shards and quantized gradients, not both")


def _betas_below_one(cfg: ZeroCacheConfig) -> None:
    """Both ``optimizer.params.betas`` are in [0, 1)."""
    b1, b2 = cfg.optimizer.params.betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ZeroConfigError(f"zero_cache config: 'optimizer.params.betas' must be in [0, 1), got {[b1, b2]}")


# Cross-key rules, checked in this order on every parsed or built config; each docstring is its documentation.
_RULES = (_one_precision, _param_offload_needs_stage3, _fp32_master_follows_optimizer, _one_nvme_path,
          _lock_free_needs_offload, _speculation_needs_unit_scale, _hierarchy_needs_stage3, _betas_below_one)


def _validate(cfg: ZeroCacheConfig) -> None:
    for rule in _RULES:
        rule(cfg)


def _warn_inert(given: list[str]) -> None:
    """One warning naming every key of ``given`` that has no effect here."""
    inert = {k.path for k in config_keys() if not k.acts}
    named = [p for p in given if p in inert]
    if named:
        logger.warning("zero_cache config: keys accepted for DeepSpeed compatibility that have no effect here: %s "
                       "(see %s)", ", ".join(named), DOC_PATH)


def parse_config(config: dict | str | os.PathLike | ZeroCacheConfig, dp_world_size: int = 1) -> ZeroCacheConfig:
    """Parse a dict, a JSON file path or an already-built config; resolve batch sizes against ``dp_world_size``.

    A JSON that sets keys without effect here gets one warning naming them; a built config is taken as is
    (no key, type or range checks, no warning), then checked by the cross-key rules and resolved like JSON."""
    given = None
    if isinstance(config, ZeroCacheConfig):
        cfg = dataclasses.replace(config)
    else:
        if isinstance(config, (str, os.PathLike)):
            if not os.path.isfile(config):
                raise ZeroConfigError(f"zero_cache config: file '{config}' does not exist; pass a dict or a JSON path")
            config = read_json(config)
        given = []
        cfg = _build(ZeroCacheConfig, config, "", given)
    _validate(cfg)
    _resolve_batch(cfg, dp_world_size)
    _resolve_overlap(cfg, given)
    if given:
        _warn_inert(given)
    return cfg


def read_json(path: str | os.PathLike) -> Any:
    """A JSON config file. A key given twice in one object is an error: json keeps the last one silently."""
    def unique(pairs: list[tuple[str, Any]]) -> dict:
        twice = sorted(k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1)
        if twice:
            raise ZeroConfigError(f"zero_cache config: '{path}' gives {', '.join(repr(k) for k in twice)} twice in "
                                  f"one object; keep one")
        return dict(pairs)

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=unique)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZeroConfigError(f"zero_cache config: '{path}' is not valid JSON: {e}") from None


# ---- documentation ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigKey:
    """One JSON key as documented by its field: what the generator and the inert-key warning read."""
    path: str  # dotted JSON path, e.g. zero_optimization.offload_param.device
    type: str  # JSON type: bool, int, float, string, [float, float], object; "or null" when it may be null
    default: Any  # the dataclass default (None for a block)
    lo: Any  # inclusive numeric bounds parsing enforces (None: unbounded)
    hi: Any
    choices: tuple | None  # the allowed values (None: any of the type)
    doc: str  # what the key does in this engine
    acts: bool  # False: accepted for DeepSpeed compatibility, no effect; setting it warns
    block: type | None  # the block's dataclass when the key holds a JSON object


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_type_name(inner)} or null"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if dataclasses.is_dataclass(tp):
        return "object"
    return {bool: "bool", int: "int", float: "float", str: "string"}[tp]


def config_keys(cls: type = ZeroCacheConfig, path: str = "") -> list[ConfigKey]:
    """Every key of block ``cls`` (at JSON path ``path``) and of the blocks inside it, depth first."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, meta, full = hints[f.name], f.metadata, f"{path}.{f.name}" if path else f.name
        block = tp if dataclasses.is_dataclass(tp) else None
        default = None if block is not None else f.default
        out.append(ConfigKey(full, _type_name(tp), default, meta.get("lo"), meta.get("hi"), meta.get("choices"),
                             meta.get("doc", ""), meta.get("acts", True), block))
        if block is not None:
            out.extend(config_keys(block, full))
    return out
