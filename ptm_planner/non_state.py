"""The planner's estimate of the memory that is not model state: gathered parameters, gradient reduce buffers and
the reduce-scatter results that do not land in their shard, activations and the loss's logits (what this
trainer's model keeps, ptm_planner/activations.py), activations moved to host memory by --cpu-offloading, and a
per-process runtime overhead. The model states themselves come from the engine's own placement code (plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core.transformer_config import TransformerConfig
from ptm_planner.activations import (
    ActivationLayout,
    ActivationMemory,
    ActivationSetup,
    activation_memory,
    moe_mlp_bytes,
)
from ptm_planner.stages import Mesh, StageModel
from zero_cache.host_memory import START_UP_MMAP_THRESHOLD
from zero_cache.partition import ChunkPlan

GiB = 2**30


@dataclass(frozen=True)
class RuntimeOverhead:
    """Per-process memory that is neither model state nor activations (interpreter, libraries, allocator)."""
    host: int
    device: int


# CPU: pretrain_gpt.py peaks at 0.32 GiB RSS on a 60k-parameter model here (torch 2.13, gloo, with and
# without --deepspeed); 0.5 GiB leaves room for data-loader buffers and allocator slack.
CPU_OVERHEAD = RuntimeOverhead(host=GiB // 2, device=0)
# CUDA (not measured on this machine): the CUDA context and caching-allocator slack on the device, the
# CUDA libraries mapped into every process on the host.
CUDA_OVERHEAD = RuntimeOverhead(host=2 * GiB, device=GiB)
# CPU with full recompute: what glibc's heap keeps per transformer layer and micro-batch in flight, in layer
# inputs (s*b*h elements), beyond the one input the recompute saves: the recomputed block's intermediates and
# gradients below the 4 MiB mmap threshold (zero_cache/host_memory.py) and its fragmentation around the saved
# inputs. Fitted to the peak RSS of a rank in 2-rank runs of the max-scale family with states on SSD
# (benchmarks/RESULTS.md, "At the edge of RAM"): without this term the plan was 0.29 GiB above it at 18 layers
# and 1.63 GiB below it at 106; with it, 0.61 and 0.24 GiB above. Measured with reuse_freed_host_memory false,
# which the planner writes (ds_config). Layer inputs of 4 MiB and more (long sequences) are mapped on their own
# (zero_cache/host_memory.py), as is most of what a recomputed block allocates: no heap to fragment, no term.
CPU_HEAP_PER_RECOMPUTED_LAYER = 9


@dataclass(frozen=True)
class NonState:
    gathered: int  # stage-3 parameters gathered for compute (compute dtype)
    reduce_buffers: int  # gradient chunks being reduce-scattered (compute dtype)
    # With the chosen recompute setting: what the stage keeps for the backward, and what a layer's backward needs
    # beyond the logits' peak (ActivationMemory: their sum with ``logits`` is the activations' peak).
    activations: int
    activations_full: int  # the same without full recompute (the requested granularity: none or selective)
    activations_recompute: int  # with full recompute
    logits: int
    overhead_device: int
    overhead_host: int
    offloaded: int = 0  # activations --cpu-offloading moved to host memory, with the chosen recompute setting
    snapshots: int = 0  # in-memory snapshots (--non-persistent-ckpt-type local) in host memory

    @property
    def device_side(self) -> int:
        return (self.gathered + self.reduce_buffers + self.activations + self.logits
                + self.overhead_device)

    @property
    def host_side(self) -> int:
        return self.overhead_host + self.offloaded + self.snapshots


def layer_activation_bytes(cfg: TransformerConfig, micro_batch: int, tp: int, moe: bool = False) -> float:
    """Korthikanti et al. 2022's estimate of the activations one transformer layer keeps (without sequence
    parallelism), the planner's before ptm_planner/activations.py and now its reference
    (benchmarks/activation_memory.py prints both): s*b*h*(10 + (8 + 4*f/h*m)/t) + 5*a*s^2*b/t bytes in 16-bit
    (m = 2 with SwiGLU), which is s*b*h*(34 + 5*a*s/h) for f = 4h, t = 1; fp32 doubles it.

    An MoE layer's MLP term is its experts' instead (moe_mlp_bytes), plus its shared expert's like a dense MLP.
    """
    s, b, h, a = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.num_attention_heads
    elem = cfg.params_dtype.itemsize
    m = 2 if cfg.swiglu else 1
    ffn = cfg.ffn_hidden_size
    if moe:
        ffn = cfg.moe.shared_expert_intermediate_size or 0
    per_layer = (s * b * h * (10 + (8 + 4 * ffn / h * m) / tp) + 5 * a * s * s * b / tp) * elem / 2
    return per_layer + (moe_mlp_bytes(cfg, s * b, tp) if moe else 0)


def stage_activations(cfg: TransformerConfig, mesh: Mesh, layout: ActivationLayout, stage: StageModel,
                      micro_batch: int, recompute: str | None, device: str) -> ActivationMemory:
    """The activations of one rank of pipeline stage ``stage`` (activations.py) under the request's layout."""
    setup = ActivationSetup(seq_length=cfg.seq_length, micro_batch=micro_batch, tp=mesh.tp,
                            sequence_parallel=layout.sequence_parallel, cp=mesh.cp, cp_comm_type=layout.cp_comm_type,
                            pp=mesh.pp, stage=stage.stage, virtual_stages=layout.virtual_stages(stage.num_layers),
                            pipeline_schedule=layout.pipeline_schedule or "1f1b",
                            recompute=recompute,
                            offloaded_layers=layout.offloaded_layers, device=device)
    return activation_memory(cfg, setup, stage.num_layers, stage.moe_layers)


# Reduce-scatter results the gradient reducer keeps for reuse (zero_cache/grad_reducer.py, ``results``):
# max_param_reduce_events + 1, with the planner's max_param_reduce_events of 1 (plan.py, ds_config).
RESULT_BUFFERS = 2


def reduce_result_bytes(plans: list[ChunkPlan], elem: int) -> int:
    """The buffers of reduce-scatter results that miss their gradient shard (a shard on SSD, a later
    micro-batch, a 16-bit buffer; a step's first fp32 result lands in a shard in memory): 2 of the largest shard
    split over several ranks. A chunk whose shard group is one rank (the experts' when EP equals DP) reduces
    nothing: its buffer is its result, and it needs none of them (its "shard" would be the whole chunk)."""
    return RESULT_BUFFERS * max((c.shard for c in plans if c.shard < c.padded), default=0) * elem


def non_state(cfg: TransformerConfig, mesh: Mesh, stage: StageModel, plans: list[ChunkPlan], *,
              micro_batch: int, recompute: bool, arena: int, cpu: bool, overhead: RuntimeOverhead,
              layout: ActivationLayout, results_miss_shards: bool = False, secondary: int = 0) -> NonState:
    """One pipeline stage's memory besides its states: ``arena`` elements of gathered parameters
    (max_contigous_params_size, allocated whole at start-up), reduce buffers, activations and logits of
    ``micro_batch`` (``recompute``: full, else the layout's granularity), and ``overhead``; ``cpu``: the device
    tier is host memory (glibc's heap term applies); ``results_miss_shards``: gradient shards may be on SSD, or
    micro-batches accumulate (``reduce_result_bytes``); ``secondary``: elements of hpZ's secondary shards, kept
    gathered beside the arena for the step."""
    elem = cfg.params_dtype.itemsize
    largest = max((c.padded for c in plans), default=0)
    gathered = (arena + secondary) * elem
    # max_param_reduce_events (1) reduction in flight and one chunk accumulating, then one more chunk: the
    # gradient of a parameter outside the fused layers, or the results that miss their shard, the larger (the
    # fused layers leave only small parameters' gradients). Measured on the dense family with states on SSD
    # (tests/tools/test_plan_memory.py), one chunk covers the results of groups of 2 or more ranks; a group
    # of one rank had two whole chunks of them before it reduced in place (benchmarks/RESULTS.md, "Max scale").
    results = reduce_result_bytes(plans, elem) if results_miss_shards or cfg.params_dtype != torch.float32 else 0
    reduce = min(sum(c.padded for c in plans) * elem, 2 * largest * elem + max(largest * elem, results))
    device = "cpu" if cpu else "cuda"
    mem = {rc: stage_activations(cfg, mesh, layout, stage, micro_batch, "full" if rc else layout.granularity,
                                 device) for rc in (False, True)}
    # Beyond the logits' peak, which the report shows on its own.
    acts = {rc: m.saved + max(0, m.working - m.logits) for rc, m in mem.items()}
    local = cfg.seq_length // mesh.cp * micro_batch * cfg.hidden_size * elem // layout.seq_split(mesh.tp)
    if cpu and local < START_UP_MMAP_THRESHOLD:  # a layer input; from the threshold on, mapped on its own
        in_flight = mesh.pp - stage.stage
        acts[True] += int(CPU_HEAP_PER_RECOMPUTED_LAYER * in_flight * stage.num_layers * local)
    return NonState(gathered, reduce, acts[recompute], acts[False], acts[True], mem[recompute].logits,
                    overhead.device, overhead.host, mem[recompute].host)
