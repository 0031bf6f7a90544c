"""Predicted time of one training step of a GPT on a cluster profile (profiles.py), part by part.

The parts are the step's own (docs/planner.md#step-time-model):

- GEMMs, call by call: a call of F FLOPs takes F / (e x peak) + c, e the share of peak a large GEMM reaches and c
  a fixed per-call cost, so small GEMMs (small hidden sizes, many experts, tensor parallelism) are slower. The
  backward runs two GEMMs of the forward's size per forward GEMM (input and weight gradients).
- Attention: a flash kernel (the causal half skipped, so 1/2 of the full product's FLOPs; its backward does 2.5x
  the forward's work) at its own share of peak; or a materialized score matrix (Megatron's 2021 kernels): both
  products at full size as batched GEMMs, plus the score matrix's reads and writes in memory.
- Elementwise work (norms, bias + activation, dropout, residuals, the loss's softmax): bytes over memory bandwidth.
  Without sequence parallelism every tensor-parallel rank does all of it.
- Recompute: full repeats the layer's forward (its GEMMs, attention, elementwise work and collectives) in the
  backward; selective repeats the attention core.
- Collectives, each over the link its group uses: Megatron orders ranks TP fastest, then CP, DP, then PP, so a
  group of size n and rank stride s has min(n, node / s) members per node; inside a node it runs on NVLink, across
  nodes at the network rate of the GPUs a node devotes to it (members per node x per-GPU rate), never faster than
  NVLink. A ring all-reduce of B bytes costs 2 (n-1)/n B / rate + 2 (n-1) latency; all-gather and reduce-scatter
  half that. TP: two all-reduces (or all-gather + reduce-scatter with sequence parallelism) per layer in the
  forward, two in the backward, not overlapped. CP: the ring's key/value exchange beside the attention core
  (only the excess shows), or Ulysses' all-to-alls / the key-value all-gather in line. EP: dispatch and combine
  all-to-alls in line; the busiest expert rank's load (imbalance factor) sets the expert GEMMs' time.
- Pipeline: the slowest stage (the last: it also computes the logits) times (m + (p - 1) / v) micro-batches for
  1F1B (v = 1) and the interleaved schedule (v model chunks per stage); the activations' point-to-point sends on
  the critical path (1/TP of them each with Megatron's scatter-gather).
- Data parallelism: DDP's gradient all-reduce (or the distributed optimizer's reduce-scatter + all-gather, the
  same bytes) beside the last micro-batch's backward when overlapped, else after it; ZeRO-3's gathers and
  reduce-scatter beside each micro-batch's compute (prefetched; only the excess shows), with the hierarchical
  layouts' and quantized collectives' bytes (docs/zero_cache/hierarchical.md).
- The optimizer: Adam on the device (memory bound), or the offload lanes of step_time.py (host Adam, SSD
  sub-groups, copies beside compute) when states live on the host or SSD.
- A fixed host time per step (data loading, logging).

Every prediction carries the error its profile's validation measured (ClusterProfile.expected_error:
benchmarks/planner_paper_table.py for the named GPU clusters, benchmarks/planner_validation.py for a measured one).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.pipeline_parallel import zero_bubble
from ptm_planner.profiles import GB, ClusterProfile
from ptm_planner.step_time import StepBreakdown

# Elementwise element accesses per token and layer in the forward, in units of the hidden width h (norms 2 x 2,
# the two fused bias + dropout + residual adds 2 x 3.5) and of the ffn width f (bias + activation: read and
# write, 3 with SwiGLU's product); the backward makes twice as many.
ELEMENTWISE_H = 11.0
ELEMENTWISE_F = 2.0
# Bytes per score element of a materialized attention's forward: the QK^T product written, the fused scale +
# mask + softmax's read and write, dropout's read, write and mask, and the read by the second product (fp16);
# 4 fewer without attention dropout. The backward moves twice as many.
SCORE_BYTES_FWD = 13.0
SCORE_BYTES_NO_DROPOUT = 9.0
FLASH_BACKWARD = 2.5  # a flash kernel's backward work against its forward (5 products against 2, recomputed scores)
LOSS_BYTES_PER_LOGIT = 16.0  # fp32 softmax cross-entropy: the logits read and written twice, forward and backward


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    query_groups: int
    head_dim: int
    ffn: int
    vocab: int
    seq: int
    swiglu: bool = False
    attention_dropout: bool = True
    moe_layers: int = 0  # layers whose MLP is a mixture of experts
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        """From a megatron.core TransformerConfig."""
        moe = cfg.moe
        moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers))) if moe is not None else 0
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
                   cfg.ffn_hidden_size, cfg.padded_vocab_size, cfg.seq_length, cfg.swiglu, cfg.attention_dropout > 0,
                   moe_layers, moe.num_experts if moe else 0, moe.router_topk if moe else 0,
                   moe.expert_ffn_hidden_size(cfg.ffn_hidden_size) if moe else 0)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.query_groups * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.swiglu else 2

    def layer_params(self) -> int:
        """Weights of one dense layer (biases and norms left out: they do not change a step's time)."""
        h = self.hidden
        return h * (self.q_width + 2 * self.kv_width) + self.q_width * h + self.mlp_matrices * h * self.ffn

    def params(self) -> int:
        return self.layers * self.layer_params() + self.vocab * self.hidden


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1  # data-parallel replicas (the context-parallel ranks of a replica not counted)
    virtual_stages: int = 1  # model chunks per pipeline stage (interleaved 1F1B)
    schedule: str = "1f1b"  # with one chunk per stage: 1f1b | zb-h1
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"  # p2p | a2a | allgather
    pp_scatter_gather: bool = True  # Megatron's: each TP rank sends 1/TP of the activation between stages

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def bubble_micro_batches(self, micro_batches: int) -> float:
        """The pipeline's fill and drain, in micro-batches of the slowest stage: (p - 1) / v for 1F1B and the
        interleaved schedule; ZB-H1's from its rounds, a micro-batch's forward, input and weight gradients taken
        as equal thirds."""
        if self.pp == 1:
            return 0.0
        if self.schedule == "zb-h1":
            return zero_bubble.bubble(self.pp, micro_batches) * micro_batches
        return (self.pp - 1) / self.virtual_stages


@dataclass(frozen=True)
class DataParallel:
    """How gradients and parameters move between data-parallel ranks."""
    kind: str = "ddp"  # ddp (all-reduce, or the distributed optimizer's reduce-scatter + all-gather) | zero3
    overlap: bool = True  # ddp: the all-reduce runs beside the last micro-batch's backward
    grad_bytes: int = 2  # bytes per gradient element reduced (ddp)
    layout: str = "flat"  # zero3: flat | hpz | mics (docs/zero_cache/hierarchical.md)
    quantized_weights: bool = False  # zero3: int8 weight gathers (qwZ)
    quantized_gradient_bits: int = 0  # zero3: 4 or 8 bits across nodes (qgZ); 0 exact
    keep_gathered: bool = False  # zero3: the forward's gathers serve the backward (one gather per step)
    block: int = 256  # quantization_block_size (the engine's default): one fp32 scale per block


@dataclass(frozen=True)
class Workload:
    model: ModelShape
    parallel: Parallel
    micro_batch: int
    micro_batches: int  # per step and pipeline (gradient accumulation)
    recompute: str | None = None  # None | selective | full
    attention: str = "flash"  # flash | materialized
    dtype_bytes: int = 2
    data_parallel: DataParallel = DataParallel()
    moe_imbalance: float = 1.0  # the busiest expert rank's tokens against the mean
    host_overhead_s: float = 0.0
    stage_params: int | None = None  # weights of the largest stage on one rank (None: from the model's shape)
    active_params: int | None = None  # of the whole model, what a token computes with (None: from the shape)

    def __post_init__(self):
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"recompute {self.recompute!r}: use None, 'selective' or 'full'")
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention {self.attention!r}: use 'flash' or 'materialized'")

    @property
    def tokens(self) -> int:
        """Tokens of one step, all replicas."""
        return self.micro_batch * self.model.seq * self.micro_batches * self.parallel.dp

    def params_per_rank(self) -> int:
        """Weights one rank computes with on the largest stage: its layers and the output layer, 1/TP each."""
        if self.stage_params is not None:
            return self.stage_params
        m, p = self.model, self.parallel
        return (-(-m.layers // p.pp) * m.layer_params() + m.vocab * m.hidden) // p.tp


@dataclass
class Term:
    name: str
    seconds: float
    note: str = ""


@dataclass
class StepPrediction:
    """Seconds per step and its parts. ``micro_batch`` terms are one micro-batch on the slowest stage; the step
    is (micro-batches + bubble) x their sum plus the ``step`` terms."""
    micro_batch: list[Term]
    step: list[Term]
    micro_batches: int
    bubble_micro_batches: float  # Parallel.bubble_micro_batches
    tokens: int
    gpus: int
    model_flops: float  # 6 x active parameters x tokens + attention (causal), no recompute: the MFU convention
    peak_flops: float
    expected_error: float
    offload: StepBreakdown | None = None

    @property
    def micro_batch_s(self) -> float:
        return sum(t.seconds for t in self.micro_batch)

    @property
    def pipeline_s(self) -> float:
        return (self.micro_batches + self.bubble_micro_batches) * self.micro_batch_s

    @property
    def bubble_s(self) -> float:
        return self.bubble_micro_batches * self.micro_batch_s

    @property
    def step_s(self) -> float:
        return self.pipeline_s + sum(t.seconds for t in self.step)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.gpus / self.peak_flops

    def lines(self) -> list[str]:
        ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
        out = [f"  step {ms(self.step_s)} (expected error +-{self.expected_error:.0%}): {self.tokens_per_s:,.0f} "
               f"tokens/s, {self.tflops_per_gpu:.0f} model TFLOP/s per GPU, MFU {self.mfu:.0%}",
               f"  pipeline {ms(self.pipeline_s)} = ({self.micro_batches} micro-batches + bubble "
               f"{self.bubble_micro_batches:.2f}) x {ms(self.micro_batch_s)} per micro-batch on the slowest stage:"]
        out += [f"    {t.name} {ms(t.seconds)}{f' ({t.note})' if t.note else ''}" for t in self.micro_batch
                if t.seconds > 0]
        out += [f"  {t.name} {ms(t.seconds)}{f' ({t.note})' if t.note else ''}" for t in self.step if t.seconds > 0]
        return out


# ---- links and collectives ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupLink:
    bytes_per_s: float
    latency_s: float
    spans_nodes: bool


def group_link(size: int, stride: int, profile: ClusterProfile) -> GroupLink:
    """The link a group of ``size`` ranks ``stride`` apart runs on (module docstring)."""
    node = profile.gpus_per_node
    if size * stride <= node:
        return GroupLink(profile.intra.gbps * GB, profile.intra.latency_us * 1e-6, False)
    per_node = max(1, min(size, node // stride))
    rate = min(profile.intra.gbps, profile.inter.gbps * per_node)
    return GroupLink(rate * GB, profile.inter.latency_us * 1e-6, True)


def all_reduce_s(nbytes: float, n: int, link: GroupLink) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / link.bytes_per_s + 2 * (n - 1) * link.latency_s


def all_gather_s(nbytes: float, n: int, link: GroupLink) -> float:
    """All-gather (or reduce-scatter) whose full result is ``nbytes``; also an all-to-all of ``nbytes``."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s


def p2p_s(nbytes: float, link: GroupLink) -> float:
    return nbytes / link.bytes_per_s + link.latency_s


# ---- compute ------------------------------------------------------------------------------------------
def gemm_s(flops: float, profile: ClusterProfile) -> float:
    """One GEMM call of ``flops``."""
    a = profile.accelerator
    return flops / (a.gemm_efficiency * a.peak_tflops * 1e12) + a.gemm_call_us * 1e-6


def memory_s(nbytes: float, profile: ClusterProfile) -> float:
    a = profile.accelerator
    return nbytes / (a.memory_gbps * GB * a.memory_efficiency)


def predict(w: Workload, profile: ClusterProfile, offload: StepBreakdown | None = None) -> StepPrediction:
    """The step of ``w`` on ``profile``; ``offload``: the host-side lanes (step_time.predict) when states live
    on the host or SSD, whose copies run beside the forward and backward and whose optimizer replaces the
    device's Adam."""
    m, p, e = w.model, w.parallel, w.dtype_bytes
    tp_link = group_link(p.tp, 1, profile)
    cp_link = group_link(p.cp, p.tp, profile)
    ep_link = group_link(p.ep, p.tp * p.cp, profile)
    dp_link = group_link(p.dp * p.cp, p.tp, profile)  # ZeRO and DDP reduce over data x context ranks
    pp_link = group_link(p.pp, p.tp * p.cp * p.dp, profile)
    t = w.micro_batch * m.seq // p.cp  # tokens of a micro-batch on one rank
    h, f, tp = m.hidden, m.ffn, p.tp
    layers = -(-m.layers // p.pp)  # the largest stage's
    moe_share = m.moe_layers / m.layers if m.layers else 0.0
    full = w.recompute == "full"
    passes = 4 if full else 3  # forward, two backward GEMMs per forward GEMM, and the recomputed forward

    # GEMMs of one layer: QKV, projection, MLP (dense) per call, forward; the backward doubles each.
    dense_calls = [2 * t * h * (m.q_width + 2 * m.kv_width) / tp, 2 * t * m.q_width * h / tp]
    mlp_calls = [2 * t * h * f * (m.mlp_matrices - 1) / tp, 2 * t * f * h / tp]
    attn_gemm = sum(gemm_s(c, profile) for c in dense_calls)
    dense_mlp = sum(gemm_s(c, profile) for c in mlp_calls)
    moe_mlp = 0.0
    if m.moe_layers:
        local = max(1, m.experts // p.ep)
        per_expert = t * m.topk * w.moe_imbalance / local  # tokens each local expert computes
        fe = m.expert_ffn
        moe_mlp = local * (gemm_s(2 * per_expert * h * fe * (m.mlp_matrices - 1) / tp, profile)
                           + gemm_s(2 * per_expert * fe * h / tp, profile)) + gemm_s(2 * t * h * m.experts, profile)
    mlp = (1 - moe_share) * dense_mlp + moe_share * moe_mlp
    gemms = layers * (attn_gemm + mlp) * passes

    # Attention core.
    heads = m.heads / tp
    s_kv = m.seq  # each query attends to the whole sequence's keys (a CP rank holds 1/CP of the queries)
    core_flops = 4 * w.micro_batch * heads * (m.seq / p.cp) * s_kv * m.head_dim  # both products, full
    a = profile.accelerator
    if w.attention == "flash":
        fwd = core_flops / 2 / (a.flash_efficiency * a.peak_tflops * 1e12)
        core_fwd, core_bwd = fwd, FLASH_BACKWARD * fwd
    else:
        calls = gemm_s(core_flops / 2, profile) * 2
        scores = w.micro_batch * heads * (m.seq / p.cp) * s_kv
        per = SCORE_BYTES_FWD if m.attention_dropout else SCORE_BYTES_NO_DROPOUT
        core_fwd = calls + memory_s(scores * per, profile)
        core_bwd = 2 * calls + memory_s(2 * scores * per, profile)
    core_passes = core_fwd * (2 if w.recompute in ("full", "selective") else 1) + core_bwd
    attention = layers * core_passes

    # Elementwise work: the residual side is 1/TP with sequence parallelism, the MLP's activation always.
    res = t / tp if p.sequence_parallel and tp > 1 else t
    fwd_bytes = e * (res * ELEMENTWISE_H * h + t * ELEMENTWISE_F * f / tp * (1.5 if m.swiglu else 1))
    elementwise = layers * memory_s(fwd_bytes * (3 + (1 if full else 0)), profile)

    # Logits and the loss on the last stage.
    logits = gemm_s(2 * t * h * m.vocab / tp, profile) * 3 + memory_s(t * m.vocab / tp * LOSS_BYTES_PER_LOGIT,
                                                                      profile)

    # Tensor parallelism: 2 all-reduces (or all-gather + reduce-scatter) per layer and pass.
    tp_passes = 2 * (3 if full else 2)
    tp_comm = layers * tp_passes * all_reduce_s(t * h * e, tp, tp_link)

    # Context parallelism.
    cp_comm = 0.0
    if p.cp > 1:
        kv = 2 * t * m.kv_width / tp * e  # this rank's keys and values
        if p.cp_comm_type == "p2p":
            ring = (p.cp - 1) * p2p_s(kv, cp_link)
            hide = profile.overlaps_comm
            fwd_x = max(0.0, ring - core_fwd) if hide else ring
            bwd_x = max(0.0, 2 * ring - core_bwd) if hide else 2 * ring
            cp_comm = layers * (fwd_x * (2 if w.recompute else 1) + bwd_x)
        elif p.cp_comm_type == "a2a":
            qkv_out = t * (2 * m.q_width + 2 * m.kv_width) / tp * e * p.cp
            cp_comm = layers * (2 if w.recompute else 1) * 2 * all_gather_s(qkv_out, p.cp, cp_link)
        else:
            cp_comm = layers * (2 if w.recompute else 1) * 2 * all_gather_s(kv * p.cp, p.cp, cp_link)

    # Expert parallelism: dispatch and combine per MoE layer and pass.
    ep_comm = 0.0
    if m.moe_layers and p.ep > 1:
        routed = t * m.topk * h * e * p.ep  # the all-to-all's whole exchange, as all_gather_s counts it
        ep_comm = layers * moe_share * 2 * (3 if full else 2) * all_gather_s(routed, p.ep, ep_link)

    # Pipeline sends: forward activation and backward gradient per model chunk.
    pp_comm = 0.0
    if p.pp > 1:
        act = t * h * e / (tp if p.pp_scatter_gather else 1)
        pp_comm = 2 * p.virtual_stages * p2p_s(act, pp_link)

    compute = gemms + attention + elementwise + logits
    micro = [
        Term("GEMMs", gemms, f"{layers} layers x {passes} passes"),
        Term("attention core", attention, w.attention),
        Term("elementwise", elementwise, "norms, activations, dropout, residuals"),
        Term("logits and loss", logits),
        Term("tensor-parallel collectives", tp_comm, f"TP {tp}, {'NVLink' if not tp_link.spans_nodes else 'network'}"),
        Term("context-parallel exchange (exposed)", cp_comm, f"CP {p.cp} {p.cp_comm_type}"),
        Term("expert all-to-all", ep_comm, f"EP {p.ep}, imbalance {w.moe_imbalance:g}"),
        Term("pipeline sends", pp_comm, f"{'network' if pp_link.spans_nodes else 'NVLink'}"),
    ]

    params = w.params_per_rank()
    shard = p.dp * p.cp
    step_terms: list[Term] = []
    dpc = w.data_parallel
    if dpc.kind == "ddp":
        reduce = all_reduce_s(params * dpc.grad_bytes, shard, dp_link)
        window = compute * 2 / 3 if dpc.overlap and profile.overlaps_comm else 0.0  # the last micro-batch's backward
        step_terms.append(Term("data-parallel gradient all-reduce (exposed)", max(0.0, reduce - window),
                               f"{reduce * 1e3:.1f} ms over DP {shard}, "
                               f"{'network' if dp_link.spans_nodes else 'NVLink'}"))
        opt_elems = params
    elif dpc.kind == "zero3":
        per_mb, per_step = zero3_comm_s(params, shard, e, dpc, w.micro_batches, profile, p.tp)
        beside = compute if profile.overlaps_comm else 0.0
        exposed = max(0.0, per_mb - beside) * w.micro_batches + per_step
        step_terms.append(Term("ZeRO-3 gathers and reductions (exposed)", exposed,
                               f"{per_mb * 1e3:.1f} ms a micro-batch beside {compute * 1e3:.1f} ms of compute, "
                               f"{dpc.layout}"))
        opt_elems = params // max(1, shard)
    else:
        raise ValueError(f"data-parallel kind {dpc.kind!r}: use 'ddp' or 'zero3'")

    if offload is None:
        step_terms.append(Term("optimizer (device Adam)", opt_elems / profile.device_adam_elems_per_s))
    else:
        pipeline = (w.micro_batches + p.bubble_micro_batches(w.micro_batches)) * sum(x.seconds for x in micro)
        copies = max(offload.h2d_s, offload.d2h_s)
        if not profile.overlaps_comm:
            copies, pipeline = offload.h2d_s + offload.d2h_s, 0.0
        step_terms.append(Term("host copies beyond compute", max(0.0, copies - pipeline),
                               f"to the device {offload.h2d_s * 1e3:.1f} ms, to the host {offload.d2h_s * 1e3:.1f} ms"))
        step_terms.append(Term("optimizer (device Adam beside the host lane)", offload.optimizer_s,
                               f"device {offload.device_adam_s * 1e3:.1f} ms, host lane "
                               f"{offload.host_lane_s * 1e3:.1f} ms"))
    if w.host_overhead_s:
        step_terms.append(Term("host time", w.host_overhead_s, "data loading, logging"))

    active = w.active_params or m.layers * (m.layer_params() - (moe_share * m.mlp_matrices * h
                                                                 * (f - m.topk * m.expert_ffn)
                                                                 if m.moe_layers else 0)) + m.vocab * h
    attn_model = 4 * m.seq * m.q_width * m.layers / 2 * 3  # per token, causal, forward + backward
    model_flops = (6 * active + attn_model) * w.tokens
    return StepPrediction(micro, step_terms, w.micro_batches, p.bubble_micro_batches(w.micro_batches), w.tokens, p.gpus,
                          model_flops, profile.accelerator.peak_tflops * 1e12, profile.expected_error, offload=offload)


def zero3_comm_s(params: int, shard: int, e: int, dpc: DataParallel, micro_batches: int,
                 profile: ClusterProfile, stride: int) -> tuple[float, float]:
    """ZeRO-3's collectives of one rank: (seconds per micro-batch, seconds once a step)."""
    if shard <= 1:
        return 0.0, 0.0
    group = group_link(shard, stride, profile)
    node_members = max(1, min(shard, profile.gpus_per_node // stride))
    node = group_link(node_members, stride, profile)
    full = params * e
    quant = params * (1 + 4 / dpc.block)  # int8 and its fp32 scales
    weights = quant if dpc.quantized_weights else full
    layout = dpc.layout if node_members < shard else "flat"
    per_step = 0.0
    if layout == "mics":
        gathers = all_gather_s(weights, node_members, node) * (1 if dpc.keep_gathered else 2)
        reduce = all_gather_s(full, node_members, node)
        replicas = shard // node_members
        per_step = all_reduce_s(full / node_members, replicas, group_link(replicas, stride * node_members, profile))
    else:
        forward = all_gather_s(weights, shard, group)
        backward = 0.0 if dpc.keep_gathered else \
            all_gather_s(full, node_members, node) if layout == "hpz" else all_gather_s(weights, shard, group)
        gathers = forward + backward
        if dpc.quantized_gradient_bits:
            inter = params / node_members * (dpc.quantized_gradient_bits / 8 + 4 / dpc.block)
            reduce = all_gather_s(full, node_members, node) + all_gather_s(inter, shard // node_members, group)
        else:
            reduce = all_gather_s(full, shard, group)
    if dpc.keep_gathered:
        per_step += gathers
        gathers = 0.0
    return gathers + reduce, per_step
