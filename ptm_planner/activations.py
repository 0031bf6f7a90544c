"""Activation memory of one pipeline stage of this trainer's GPT, per rank: the tensors autograd keeps from the
forward for the backward, counted from what megatron/model/ saves (not Korthikanti et al.'s formula, which
non_state.layer_activation_bytes keeps as a reference), and the transients on top of them.

Per token a rank holds (e: bytes of the compute dtype; h hidden, f ffn, a heads, g query groups, d head size,
t TP, r = t with --sequence-parallel else 1; a rank holds s / CP tokens of every sequence):

- residual side, / r: each norm's input (RMSNorm also its normalised input) and statistics, the two hidden
  dropout masks (dtype-sized on the CPU, where torch's dropout saves a scaled mask; 1 byte on CUDA);
- the inputs of the column-parallel layers (QKV, fc1): h*e each, whole under sequence parallelism too (the
  layers save what the all-gather made; SwiGLU's gate then gathers a copy of its own);
- attention (heads / t): q, k, v as the kernel gets them and its output (shared with the projection's input),
  plus the fp32 log-sum-exp, for torch's flash-style SDPA (CUDA, or attention dropout 0 on the CPU); the CPU's
  math kernel (attention dropout > 0) keeps fp32 q, k, v and three fp32 [s, s] score tensors per head instead;
  selective recompute keeps only the core's inputs and output; context parallelism keeps the output twice (ring
  attention's and the projection's copy; Ulysses' in the head layout and exchanged back), and its all-gather
  kind the whole sequence's keys and values (2 CP g d / t each token of the rank);
- the MLP: fc1's output and fc2's input, f/t each (SwiGLU: gate output, its SiLU, fc1's output, product).

A stage holds that for every layer of the model chunks in flight (1F1B: PP - stage; interleaved: Megatron's
warm-up count), the first stage also the embedding's dropout mask, the last stage the final norm and the output
layer's input. Full recompute keeps only each recompute block's input and rebuilds one block in the backward;
--cpu-offloading moves the first N layers of each chunk to host memory, two of them back on the device at a
time for the backward. On top come the loss's logits (last stage) or a layer's backward, whichever is larger.
Tested tensor by tensor against the model (tests/planner/test_long_context_plan.py) and measured against peak
RSS (benchmarks/activation_memory.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.core.transformer_config import CP_COMM_TYPES, TransformerConfig

RECOMPUTE = (None, "selective", "full")
FP32 = 4  # bytes: softmax statistics, the log-sum-exp and the loss's math are fp32 whatever the model's dtype


@dataclass(frozen=True)
class ActivationLayout:
    """The trainer's flags that change what a rank keeps, besides the mesh's sizes and the micro-batch (the
    planner's request carries them; its options choose full recompute and the micro-batch)."""
    sequence_parallel: bool = False  # --sequence-parallel (with TP > 1)
    cp_comm_type: str = "p2p"  # --cp-comm-type
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage (interleaved 1F1B)
    granularity: str | None = None  # --recompute-granularity without full recompute: None or "selective"
    offloaded_layers: int = 0  # --cpu-offloading-num-layers per model chunk (-1: all but the chunk's last)
    # --pipeline-schedule with one model chunk per stage: 1f1b | zb-h1; None: the planner chooses (Option.schedule)
    pipeline_schedule: str | None = None

    def seq_split(self, tp: int) -> int:
        return tp if self.sequence_parallel and tp > 1 else 1

    def virtual_stages(self, layers_per_stage: int) -> int:
        """Model chunks per pipeline stage."""
        n = self.layers_per_virtual_stage
        return layers_per_stage // n if n else 1


@dataclass(frozen=True)
class ActivationSetup:
    """Everything besides the model's shape that decides what a rank keeps."""
    seq_length: int
    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False  # with tp > 1: the residual side holds 1/TP of the sequence
    cp: int = 1  # context parallelism: each rank holds seq_length / cp tokens of every sequence
    cp_comm_type: str = "p2p"  # p2p: ring attention; a2a: Ulysses all-to-all; allgather: every rank gathers k, v
    pp: int = 1
    stage: int = 0  # pipeline stage (0: the one with the most micro-batches in flight)
    virtual_stages: int = 1  # model chunks per stage (interleaved schedule)
    pipeline_schedule: str = "1f1b"  # 1f1b | zb-h1 with one model chunk per stage
    in_flight: int | None = None  # model chunks whose activations the stage holds at once; None: the schedule's
    recompute: str | None = None  # None | "selective" | "full"
    offloaded_layers: int = 0  # --cpu-offloading-num-layers, per model chunk; -1: all but the chunk's last
    dtype: torch.dtype | None = None  # compute dtype; None: the config's
    device: str = "cpu"  # "cpu" or "cuda": which dropout and attention kernels run

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}: use one of {RECOMPUTE}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type {self.cp_comm_type!r}: use one of {CP_COMM_TYPES}")

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank."""
        return self.micro_batch * self.seq_length // self.cp

    @property
    def seq_split(self) -> int:
        """How many ranks share the residual side of a token (sequence parallelism)."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes of one rank at its peak: ``saved`` stays from the forward to the backward; on top of it come the
    loss's logits (last stage) or a layer's backward, whichever is larger; ``host`` went to host memory."""
    saved: int
    working: int  # a layer's backward transients, and with recompute the block rebuilt for it
    logits: int  # the loss at its peak: logits, their fp32 copy shifted by the max and its exp (last stage)
    host: int  # moved to host memory by --cpu-offloading

    @property
    def device(self) -> int:
        return self.saved + max(self.working, self.logits)


def in_flight_chunks(pp: int, stage: int, virtual_stages: int = 1, schedule: str = "1f1b") -> int:
    """Model chunks whose activations pipeline stage ``stage`` holds at once (micro-batches >= PP): 1F1B
    warms up PP - stage - 1 forwards and then holds one more; the interleaved schedule warms up
    2 (PP - stage - 1) + (v - 1) PP chunk forwards, so stage 0 holds PP + (PP - 1) / v stages' worth of layers,
    Megatron's 1 + (PP - 1) / (PP v) factor on PP micro-batches. ZB-H1 holds at most PP micro-batches on every
    stage, counting those whose weight pass is pending (which keep less: the linear layers' inputs and output
    gradients) as whole ones."""
    if schedule == "zb-h1":
        return pp
    if virtual_stages == 1:
        return pp - stage
    return 2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1


def _dtype_bytes(cfg: TransformerConfig, setup: ActivationSetup) -> int:
    return (setup.dtype or cfg.params_dtype).itemsize


def _mask_bytes(setup: ActivationSetup, e: int) -> int:
    """A hidden dropout mask per element: torch's CPU dropout saves the scaled mask in the input's dtype, CUDA's
    fused dropout a bool."""
    return 1 if setup.device == "cuda" else e


def norm_bytes(cfg: TransformerConfig, setup: ActivationSetup) -> float:
    """One norm per token: LayerNorm keeps its input, mean and rstd (fp32 on CUDA, the input's dtype on the CPU);
    torch's RMSNorm computes in fp32 and keeps the fp32 input, the normalised input (before the weight) and
    rstd."""
    e, h = _dtype_bytes(cfg, setup), cfg.hidden_size
    stat = FP32 if setup.device == "cuda" else e
    if cfg.normalization == "RMSNorm":
        return 2 * h * FP32 + FP32
    return h * e + 2 * stat


def _flash_attention(cfg: TransformerConfig, setup: ActivationSetup) -> bool:
    """Whether SDPA runs a flash-style kernel (keeps q, k, v, out and the LSE): always on CUDA, on the CPU
    only without attention dropout (else the math kernel materialises the scores)."""
    return setup.device == "cuda" or cfg.attention_dropout == 0


def attention_bytes(cfg: TransformerConfig, setup: ActivationSetup) -> float:
    """What self-attention keeps per token of this rank, past its QKV projection's input (which the layer
    counts): q, k, v as the kernel takes them (views of the QKV output keep all of it alive), its output (the
    projection's input) and the LSE."""
    e, t = _dtype_bytes(cfg, setup), setup.tp
    heads, d = cfg.num_attention_heads // t, cfg.kv_channels
    ad, gd = heads * d, cfg.num_query_groups // t * d
    qkv_out = ad + 2 * gd
    rope, grouped = cfg.position_embedding_type == "rope", cfg.num_query_groups != cfg.num_attention_heads
    # q is a view of the QKV output unless rotated or copied out of several query groups of this rank.
    q_view = not rope and cfg.num_query_groups // t in (1, cfg.num_attention_heads // t)
    lse = heads * FP32
    # What the attention core takes: v is a view of the QKV output, which keeps all of it alive, and so are q and
    # k unless rotated (or q copied out of several query groups of this rank).
    core_inputs = qkv_out + (0 if q_view else ad) + (gd if rope else 0)
    if setup.recompute == "selective":
        # The core's inputs stay (held for its recompute), and its output as the projection's input.
        return (core_inputs + ad) * e
    if setup.cp > 1 and setup.cp_comm_type == "p2p":
        # Ring attention keeps its inputs (it repeats grouped heads block by block), its output and the LSE; the
        # projection copies the output into the sequence layout.
        return (core_inputs + 2 * ad) * e + lse
    if setup.cp > 1 and setup.cp_comm_type == "allgather":
        # All-gather: the queries (or the QKV output they are a view of), the whole sequence's keys and values (CP x
        # this rank's, un-repeated), the output and the projection's copy of it, the LSE.
        return ((qkv_out if q_view else ad) + 2 * setup.cp * gd + 2 * ad) * e + lse
    ulysses = setup.cp > 1
    if not _flash_attention(cfg, setup):
        # The math kernel: fp32 copies of q, k, v (in fp32 Ulysses' v is a view of the exchanged q, k, v, which
        # stay), the softmax, the dropout mask and the dropped softmax over the whole sequence, and the
        # projection's own (copied) input.
        inputs = 2 * ad * FP32 + 3 * ad * e if ulysses and e == FP32 else 3 * ad * FP32
        return inputs + 3 * heads * setup.seq_length * FP32 + ad * e
    if ulysses:  # q, k, v exchanged into the head layout, the output back into a copy of its own
        return 5 * ad * e + lse
    # SDPA: grouped k and v are repeated (new tensors), else views unless rotated; its output is the projection's
    # input.
    views = q_view or not grouped
    inputs = (qkv_out if views else 0) + (0 if q_view else ad) + (2 * ad if grouped else ad if rope else 0)
    return (inputs + ad) * e + lse


def mlp_bytes(cfg: TransformerConfig, setup: ActivationSetup, ffn: int | None = None) -> float:
    """The MLP's intermediates per token (its input is counted by the layer): fc1's output and fc2's input,
    f/t elements each; SwiGLU keeps the gate's output, its SiLU, fc1's output and their product."""
    f = cfg.ffn_hidden_size if ffn is None else ffn
    return (4 if cfg.swiglu else 2) * f / setup.tp * _dtype_bytes(cfg, setup)


def residual_side_bytes(cfg: TransformerConfig, setup: ActivationSetup) -> float:
    """A layer's tensors on the residual side per token of this rank: two norms and the two dropout masks,
    split by the sequence-parallel ranks."""
    e = _dtype_bytes(cfg, setup)
    masks = 2 * cfg.hidden_size * _mask_bytes(setup, e) if cfg.hidden_dropout > 0 else 0
    return (2 * norm_bytes(cfg, setup) + masks) / setup.seq_split


def moe_mlp_bytes(cfg: TransformerConfig, tokens: int, tp: int, dtype: torch.dtype | None = None) -> float:
    """The experts' activations of one MoE layer for ``tokens`` tokens of this rank: every routed row as
    dispatched (h elements) and the expert's hidden layer (fc1's output and its activation, 2*F*m/t elements,
    m = 2 with SwiGLU), and the router's fp32 logits and probabilities (2*E per token)."""
    moe = cfg.moe
    f = moe.expert_ffn_hidden_size(cfg.ffn_hidden_size)
    m = 2 if cfg.swiglu else 1
    rows = routed_rows(cfg, tokens)
    e = (dtype or cfg.params_dtype).itemsize
    return rows * (cfg.hidden_size + 2 * f * m / tp) * e + tokens * 2 * moe.num_experts * FP32


def routed_rows(cfg: TransformerConfig, tokens: int) -> int:
    """Token copies (rows) one rank's experts take per MoE layer: the k copies of each of its tokens, exchanged
    one for one over the expert-parallel ranks when the routing is even (dropless); with a capacity factor at
    most E x the capacity of an expert, whatever the routing."""
    moe = cfg.moe
    capacity = moe.capacity(tokens)
    return tokens * moe.router_topk if capacity is None else moe.num_experts * capacity


def layer_bytes(cfg: TransformerConfig, setup: ActivationSetup, moe: bool = False) -> float:
    """What one transformer layer keeps for the backward, for one micro-batch of this rank, without full
    recompute (selective recompute is ``setup.recompute``)."""
    e, h, n = _dtype_bytes(cfg, setup), cfg.hidden_size, setup.tokens
    # The column-parallel layers' inputs: QKV's and fc1's (SwiGLU's gate shares it, but under sequence parallelism
    # each layer all-gathers its own copy).
    gathered_twice = cfg.swiglu and setup.seq_split > 1 and not moe
    per_token = residual_side_bytes(cfg, setup) + attention_bytes(cfg, setup) + (3 if gathered_twice else 2) * h * e
    if not moe:
        return n * (per_token + mlp_bytes(cfg, setup))
    shared = cfg.moe.shared_expert_intermediate_size
    # The MoE MLP's input (the router's and the dispatcher's) is the layer's second h*e; a shared expert adds
    # the intermediates of a dense MLP of its width.
    dense = mlp_bytes(cfg, setup, shared) if shared else 0.0
    return n * (per_token + dense) + moe_mlp_bytes(cfg, n, setup.tp, setup.dtype)


def layer_input_bytes(cfg: TransformerConfig, setup: ActivationSetup) -> float:
    """A recompute block's input (the residual stream, split by the sequence-parallel ranks)."""
    return setup.tokens * cfg.hidden_size * _dtype_bytes(cfg, setup) / setup.seq_split


def backward_working_bytes(cfg: TransformerConfig, setup: ActivationSetup) -> float:
    """The most one layer's backward allocates beyond what it frees, for one micro-batch: in the MLP the
    residual's gradient and its dropout's, and fc2's input gradient (SwiGLU: the product's two); in attention,
    which runs once the MLP's intermediates are freed, dq, dk, dv and the QKV output's gradient (the math kernel:
    fp32 gradients of the scores, twice), and under selective recompute the core rebuilt for it."""
    e, h, t, n = _dtype_bytes(cfg, setup), cfg.hidden_size, setup.tp, setup.tokens
    heads, d = cfg.num_attention_heads // t, cfg.kv_channels
    ad, qkv_out = heads * d, (heads + 2 * cfg.num_query_groups // t) * d
    residual = 2 * h * e / setup.seq_split
    mlp = (2 if cfg.swiglu else 1) * cfg.ffn_hidden_size / t * e + residual
    scores = heads * setup.seq_length * FP32
    gd = cfg.num_query_groups // t * d
    if setup.cp > 1 and setup.cp_comm_type == "p2p":
        # Ring attention: dq in fp32, the key/value block and the one arriving, their fp32 gradient accumulator
        # with the one sent and the one arriving, and one block's dq, dk, dv (heads repeated).
        attn = ad * FP32 + 4 * gd * e + 6 * gd * FP32 + 3 * ad * e + residual
        rebuilt = ad * e + heads * FP32
    elif setup.cp > 1 and setup.cp_comm_type == "allgather":
        # dq and the gradients of every block's keys and values in fp32, one block's dq, dk, dv (heads repeated)
        # and the reduce-scatter's result.
        attn = ad * FP32 + 2 * setup.cp * gd * FP32 + 3 * ad * e + 2 * gd * FP32 + residual
        rebuilt = ad * e + heads * FP32
    elif _flash_attention(cfg, setup):
        attn = (3 * ad + qkv_out) * e + residual
        rebuilt = ad * e + heads * FP32
    else:
        attn = 2 * scores + 3 * ad * FP32 + residual
        rebuilt = 3 * scores + ad * e
    if setup.recompute == "selective":
        attn += rebuilt
    return n * max(mlp, attn - mlp_bytes(cfg, setup))


def logits_bytes(cfg: TransformerConfig, setup: ActivationSetup) -> int:
    """The loss at its peak (megatron/core/tensor_parallel/cross_entropy.py): the logits, their fp32 copy (16-bit
    models), that copy shifted by the max and its exp (kept as the softmax for the backward): 12 bytes per
    logit of this rank in fp32, 14 in 16-bit."""
    e = _dtype_bytes(cfg, setup)
    per_logit = 3 * FP32 if e == FP32 else 3 * FP32 + e
    return setup.tokens * cfg.padded_vocab_size // setup.tp * per_logit


def _chunk_layers(layers: int, cfg: TransformerConfig, setup: ActivationSetup, kept: float, recomputed: bool
                  ) -> float:
    """Bytes one model chunk of ``layers`` layers keeps, ``kept`` bytes per layer without full recompute."""
    if not recomputed:
        return layers * kept
    k = min(cfg.recompute_num_layers, layers) if layers else 0
    if not k:
        return 0.0
    inputs = layer_input_bytes(cfg, setup)
    if cfg.recompute_method == "block":  # the first k layers recomputed one by one, the rest kept whole
        return k * inputs + (layers - k) * kept
    return math.ceil(layers / k) * inputs


def activation_memory(cfg: TransformerConfig, setup: ActivationSetup, layers: int, moe_layers: int = 0
                      ) -> ActivationMemory:
    """Peak activation bytes of pipeline stage ``setup.stage`` on one rank, holding ``layers`` transformer layers
    (``moe_layers`` of them MoE) split into ``setup.virtual_stages`` model chunks."""
    v = setup.virtual_stages
    if layers % v:
        raise ValueError(f"{layers} layers per pipeline stage do not split into {v} model chunks")
    chunk = layers // v
    chunks = setup.in_flight if setup.in_flight is not None else in_flight_chunks(setup.pp, setup.stage, v,
                                                                                  setup.pipeline_schedule)
    full = setup.recompute == "full"
    dense = layer_bytes(cfg, setup) if layers > moe_layers else 0.0
    moe = layer_bytes(cfg, setup, moe=True) if moe_layers else 0.0
    # Per layer, the chunk's average (MoE layers spread over the chunks as over the stage).
    kept = ((layers - moe_layers) * dense + moe_layers * moe) / layers if layers else 0.0
    offloaded = chunk - 1 if setup.offloaded_layers < 0 else min(setup.offloaded_layers, chunk)
    per_layer = _chunk_layers(1, cfg, setup, kept, full)
    on_device = _chunk_layers(chunk - offloaded, cfg, setup, kept, full)
    on_host = _chunk_layers(offloaded, cfg, setup, kept, full)
    e = _dtype_bytes(cfg, setup)
    n, h = setup.tokens, cfg.hidden_size
    # Offloaded layers come back before their backward, the next one while one runs (two on the device); by
    # then the chunk's own later layers have run their backward, so that chunk holds no other layer.
    saved = max(chunks * on_device, (chunks - 1) * on_device + min(offloaded, 2) * per_layer)
    if cfg.position_embedding_type == "rope":  # cos and sin at the tokens' positions, one pair per chunk forward
        saved += chunks * n * 2 * cfg.kv_channels * e
    first, last = setup.stage == 0, setup.stage == setup.pp - 1
    if first:  # token ids (and with TP the local ids and which are local) and the embedding's dropout mask, for
        # the first chunk's micro-batches in flight
        mask = h * _mask_bytes(setup, e) / setup.seq_split if cfg.hidden_dropout > 0 else 0
        saved += -(-chunks // v) * n * (8 + (9 if setup.tp > 1 else 0) + mask)
    logits, head = 0, 0.0
    if last:  # the final norm, the output layer's (gathered) input, the loss's targets and which are local
        head = n * (norm_bytes(cfg, setup) / setup.seq_split + h * e + 9)
        saved += head
        logits = logits_bytes(cfg, setup)
    working = backward_working_bytes(cfg, setup)
    if full:  # the block rebuilt for its backward (its first layer's input is the block's, kept already)
        working += min(cfg.recompute_num_layers, chunk) * max(dense, moe) - layer_input_bytes(cfg, setup)
    # The last stage's head (final norm, output layer's input) is freed before any layer's backward.
    working = max(0.0, working - head)
    return ActivationMemory(int(saved), int(working), int(logits), int(chunks * on_host))
