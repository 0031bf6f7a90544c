"""The planner's estimate of the memory that is not model state: gathered parameters, gradient reduce buffers,
activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), the
loss's logits and a per-process runtime overhead. The model states themselves come from the engine's own
placement code (plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer_config import TransformerConfig
from ptm_planner.stages import Mesh, StageModel
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
# which the planner writes (ds_config).
CPU_HEAP_PER_RECOMPUTED_LAYER = 9


@dataclass(frozen=True)
class NonState:
    gathered: int  # stage-3 parameters gathered for compute (compute dtype)
    reduce_buffers: int  # gradient chunks being reduce-scattered (compute dtype)
    activations: int  # with the chosen recompute setting
    activations_full: int  # without recompute
    activations_recompute: int  # with full recompute
    logits: int
    overhead_device: int
    overhead_host: int

    @property
    def device_side(self) -> int:
        return (self.gathered + self.reduce_buffers + self.activations + self.logits
                + self.overhead_device)


def layer_activation_bytes(cfg: TransformerConfig, micro_batch: int, tp: int, moe: bool = False) -> float:
    """Activations one transformer layer keeps for backward (Korthikanti et al. 2022, without sequence
    parallelism): s*b*h*(10 + (8 + 4*f/h*m)/t) + 5*a*s^2*b/t bytes in 16-bit (m = 2 with SwiGLU), which is
    s*b*h*(34 + 5*a*s/h) for f = 4h, t = 1; fp32 doubles it.

    An MoE layer's MLP term is its experts' instead (moe_mlp_bytes), plus its shared expert's like a dense MLP.
    """
    s, b, h, a = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.num_attention_heads
    elem = cfg.params_dtype.itemsize
    m = 2 if cfg.swiglu else 1
    ffn = cfg.ffn_hidden_size
    if moe:
        ffn = cfg.moe.shared_expert_intermediate_size or 0
    per_layer = (s * b * h * (10 + (8 + 4 * ffn / h * m) / tp) + 5 * a * s * s * b / tp) * elem / 2
    return per_layer + (moe_mlp_bytes(cfg, micro_batch, tp) if moe else 0)


def routed_rows(cfg: TransformerConfig, tokens: int) -> int:
    """Token copies (rows) one rank's experts take per MoE layer: the k copies of each of its tokens, exchanged
    one for one over the expert-parallel ranks when the routing is even (dropless); with a capacity factor at
    most E x the capacity of an expert, whatever the routing."""
    moe = cfg.moe
    capacity = moe.capacity(tokens)
    return tokens * moe.router_topk if capacity is None else moe.num_experts * capacity


def moe_mlp_bytes(cfg: TransformerConfig, micro_batch: int, tp: int) -> float:
    """The experts' activations of one MoE layer: every routed row as dispatched (h elements) and the expert's
    hidden layer (fc1's output and its activation, 2*F*m/t elements, as the dense MLP's term), and the router's
    fp32 logits and probabilities (2*E per token)."""
    tokens = cfg.seq_length * micro_batch
    moe = cfg.moe
    f = moe.expert_ffn_hidden_size(cfg.ffn_hidden_size)
    m = 2 if cfg.swiglu else 1
    rows = routed_rows(cfg, tokens)
    return rows * (cfg.hidden_size + 2 * f * m / tp) * cfg.params_dtype.itemsize + tokens * 2 * moe.num_experts * 4


def activation_bytes(cfg: TransformerConfig, micro_batch: int, tp: int, layers: int, in_flight: int,
                     recompute: bool, moe_layers: int = 0) -> int:
    """Activations one rank keeps for backward over ``layers`` layers, ``moe_layers`` of them MoE
    (layer_activation_bytes). With full recompute only each recompute block's input (s*b*h elements) stays,
    plus one block's working set while it is recomputed. A 1F1B pipeline stage holds ``in_flight``
    micro-batches.
    """
    s, b, h = cfg.seq_length, micro_batch, cfg.hidden_size
    dense = layer_activation_bytes(cfg, micro_batch, tp) if layers > moe_layers else 0.0
    moe = layer_activation_bytes(cfg, micro_batch, tp, moe=True) if moe_layers else 0.0
    elem = cfg.params_dtype.itemsize
    if not recompute:
        return int(in_flight * ((layers - moe_layers) * dense + moe_layers * moe))
    k = min(cfg.recompute_num_layers, layers) if layers else 0
    blocks = -(-layers // k) if k else 0
    return int(in_flight * blocks * s * b * h * elem + k * max(dense, moe))


def non_state(cfg: TransformerConfig, mesh: Mesh, stage: StageModel, plans: list[ChunkPlan], *,
              micro_batch: int, recompute: bool, arena: int, cpu: bool, overhead: RuntimeOverhead) -> NonState:
    """One pipeline stage's memory besides its states: ``arena`` elements of gathered parameters
    (max_contigous_params_size, allocated whole at start-up), reduce buffers, activations and logits of
    ``micro_batch``, and ``overhead``; ``cpu``: the device tier is host memory (glibc's heap term applies)."""
    elem = cfg.params_dtype.itemsize
    largest = max((c.padded for c in plans), default=0)
    gathered = arena * elem
    # max_param_reduce_events reductions in flight, one chunk accumulating, one parameter's gradient.
    reduce = min(sum(c.padded for c in plans), 3 * largest) * elem
    in_flight = mesh.pp - stage.stage
    acts = {rc: activation_bytes(cfg, micro_batch, mesh.tp, stage.num_layers, in_flight, rc, stage.moe_layers)
            for rc in (False, True)}
    if cpu:
        acts[True] += int(CPU_HEAP_PER_RECOMPUTED_LAYER * in_flight * stage.num_layers * cfg.seq_length * micro_batch
                          * cfg.hidden_size * elem)
    last = stage.stage == mesh.pp - 1
    # The loss (megatron/core/tensor_parallel/cross_entropy.py) holds the logits, their fp32 copy shifted by
    # the max and its exp at once: 12 bytes per logit in fp32 (one copy is the logits), 14 in 16-bit.
    per_logit = 12 if elem == 4 else 12 + elem
    logits = cfg.seq_length * micro_batch * (cfg.padded_vocab_size // mesh.tp) * per_logit if last else 0
    return NonState(gathered, reduce, acts[recompute], acts[False], acts[True], logits, overhead.device,
                    overhead.host)
