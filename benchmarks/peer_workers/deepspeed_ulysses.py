"""DeepSpeed-Ulysses: a GPT whose attention core is ``deepspeed.sequence.layer.DistributedAttention``, each rank
holding 1/SP of every sequence, trained by DeepSpeed ZeRO; one rank of ``benchmarks.long_context_vs_peers``'s
peer row, in the peers' venv:

    torchrun --standalone --nproc-per-node 2 -m benchmarks.peer_workers.deepspeed_ulysses \
        --system deepspeed-ulysses --spec spec.json --out-dir DIR [--sp 2]

Writes ``DIR/partial_rank{r}.json`` after every step, then ``DIR/result_rank{r}.json`` (step times, losses,
peak RSS), or ``DIR/error_rank{r}.txt`` (the exception, one line, then the traceback) before failing: the files
``benchmarks/peer_workers/worker.py`` writes, so the drivers read both alike.

The model is written here in plain torch modules, the shape of our GPTModel with rotary positions
(``--position-embedding-type rope``): pre-norm LayerNorm layers, fused QKV with biases (per head q, k, v: our
layout), RoPE in the rotate-half convention, SDPA causal attention, a GeLU MLP of 4 x hidden with biases, a
final LayerNorm and an output layer tied to the word embedding, no dropout. Its parameters carry our names and
start from our initial values (ours' seeded per-name initialisers, read off our GPTModel built on the meta
device), so with the trainer's mock samples (``spec.mock_data_vocab``) it computes the losses ours does.

Sequence parallelism as DeepSpeed-Ulysses sets it up (Megatron-DeepSpeed's ``--ds-sequence-parallel-size``):

- The ranks form ``world / SP`` data-parallel replicas of ``SP`` consecutive ranks; rank ``r`` of a
  sequence-parallel group holds tokens ``[r s/SP, (r + 1) s/SP)`` of each of its micro-batches, with their
  positions (RoPE is applied to the local q and k at those positions, before the all-to-all).
- ``DistributedAttention(local_attention, sequence_group, scatter_idx=2, gather_idx=1)`` with
  ``batch_dim_idx=0`` on ``[b, s/SP, heads, d]``: an all-to-all turns q, k and v into ``[b, s, heads/SP, d]``
  (every position, 1/SP of the heads; the gathered sequence is in rank order, so causal SDPA on it is exact),
  and one more turns the output back into ``[b, s/SP, heads, d]``.
- DeepSpeed gets an ``mpu`` (``SequenceParallelMesh``) with the sequence, sequence x data and data-parallel
  groups. ZeRO then shards over and reduces over the sequence x data group and divides the sum by that group's
  size over the sequence-parallel size, i.e. by the data-parallel size (``runtime/zero/stage3.py``,
  ``stage_1_and_2.py``): the sequence-parallel ranks' gradients add up; its ``train_batch_size`` counts
  data-parallel replicas only. So each rank's loss is its tokens' loss sum over
  the micro-batch's whole token count (the sequence's mean once summed over the group), and the JSON's batch
  keys are ours: the global batch in sequences, per data-parallel replica.
- ZeRO stage and the rest of the JSON: ``BenchSpec.ds_config`` (the one ours gets; stage 3, as
  ``zero3_vs_peers`` compares). The model is built under ``deepspeed.zero.Init`` (DeepSpeed's way for
  ZeRO-3), every parameter created from its initial value inside its module's constructor so that Init
  partitions it as it is made; the tied head's weight is registered as an external parameter of the output
  layer.
- ``spec.recompute``: every transformer layer under ``torch.utils.checkpoint`` (non-reentrant), activation
  recomputation per layer as ours' ``--recompute-granularity full``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch import nn
from torch.utils.checkpoint import checkpoint

from .harness import COLLECTIVE_TIMEOUT, BenchSpec, PeakRss, param_groups, synthetic_tokens, write_error

ROTARY_BASE = 10000.0  # ours' default --rotary-base
NORM_EPS = 1e-5  # ours' default --norm-epsilon

Init = Callable[[str], torch.Tensor]  # a parameter's name -> its initial value (fp32, its shape)


class SequenceParallelMesh:
    """The ``mpu`` DeepSpeed reads its process groups from, as Megatron-DeepSpeed's parallel_state gives it for
    Ulysses: sequence-parallel groups of ``sp`` consecutive ranks, data-parallel groups across them, the
    sequence x data group (every rank here: no tensor or pipeline parallelism) and one-rank model-parallel
    groups. Every rank creates every group, in the same order (``dist.new_group``'s rule)."""

    def __init__(self, sp: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if sp < 1 or world % sp:
            raise ValueError(f"sequence-parallel size {sp} must divide the {world} ranks")
        self.sp, self.dp = sp, world // sp
        self.sp_rank, self.dp_rank = rank % sp, rank // sp
        for g in range(self.dp):
            ranks = list(range(g * sp, (g + 1) * sp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.sp_group = group
        for i in range(sp):
            ranks = list(range(i, world, sp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks
        for r in range(world):
            group = dist.new_group([r])
            if r == rank:
                self.one_rank_group = group
        self.seq_dp_group = dist.group.WORLD

    # sequence parallelism
    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    # ZeRO's sharding and gradient reduction group: sequence x data
    def get_sequence_data_parallel_group(self):
        return self.seq_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    # data parallelism: the replicas, what train_batch_size counts
    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks

    # no tensor or pipeline parallelism
    def get_model_parallel_group(self):
        return self.one_rank_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_group(self):
        return self.one_rank_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()

    def get_pipeline_model_parallel_group(self):
        return self.one_rank_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def our_initial_values(spec: BenchSpec) -> Init:
    """Our GPTModel (rotary positions) on the meta device: each parameter's seeded initialiser, by name."""
    from megatron.core import parallel_state as ps
    from megatron.core.deferred_init import initial_value
    from megatron.core.transformer_config import TransformerConfig
    from megatron.model.gpt_model import GPTModel

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, timeout=COLLECTIVE_TIMEOUT)
    cfg = TransformerConfig(num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                            seq_length=spec.seq, padded_vocab_size=spec.vocab, hidden_dropout=0.0,
                            attention_dropout=0.0, seed=spec.seed, position_embedding_type="rope")
    with torch.device("meta"):
        params = dict(GPTModel(cfg).named_parameters())
    return lambda name: initial_value(name, params[name])


class Dense(nn.Module):
    """``nn.Linear``'s computation, its weight and bias made from their initial values here, in the constructor
    (zero.Init partitions a module's parameters when its constructor returns)."""

    def __init__(self, init: Init, name: str):
        super().__init__()
        self.weight = nn.Parameter(init(f"{name}.weight"))
        self.bias = nn.Parameter(init(f"{name}.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class WordEmbedding(nn.Module):
    def __init__(self, init: Init, name: str):
        super().__init__()
        self.weight = nn.Parameter(init(f"{name}.weight"))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class Embedding(nn.Module):
    def __init__(self, init: Init):
        super().__init__()
        self.word_embeddings = WordEmbedding(init, "embedding.word_embeddings")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens)


class OutputLayer(nn.Module):
    """The head: logits against the word embedding (tied; registered as this module's external parameter)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


def rotary(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [b, s, 1, dim] at ``positions`` [b, s] (rotate-half convention, both halves alike)."""
    inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LocalAttention(nn.Module):
    """What each rank computes between the two all-to-alls: causal SDPA over the whole sequence for its heads,
    on and back to ``[b, s, heads / SP, d]``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, init: Init, prefix: str, heads: int, head_dim: int, sp_group):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.linear_qkv = Dense(init, prefix + "linear_qkv")
        self.linear_proj = Dense(init, prefix + "linear_proj")
        # batch first [b, s, heads, d]: scatter the heads (2), gather the sequence (1); batch_dim_idx=0 below
        self.core = DistributedAttention(LocalAttention(), sp_group, scatter_idx=2, gather_idx=1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.linear_qkv(x).view(b, s, self.heads, 3, self.head_dim)  # ours: per head [q, k, v]
        q, k, v = qkv.unbind(3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, 0)
        return self.linear_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, init: Init, prefix: str):
        super().__init__()
        self.linear_fc1 = Dense(init, prefix + "linear_fc1")
        self.linear_fc2 = Dense(init, prefix + "linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, init: Init, i: int, spec: BenchSpec, sp_group):
        super().__init__()
        prefix = f"decoder.layers.{i}."
        self.input_layernorm = nn.LayerNorm(spec.hidden, eps=NORM_EPS)  # ones and zeros: ours' initial values
        self.self_attention = SelfAttention(init, prefix + "self_attention.", spec.heads, spec.hidden // spec.heads,
                                            sp_group)
        self.pre_mlp_layernorm = nn.LayerNorm(spec.hidden, eps=NORM_EPS)
        self.mlp = MLP(init, prefix + "mlp.")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, init: Init, spec: BenchSpec, sp_group):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(init, i, spec, sp_group) for i in range(spec.layers))
        self.recompute = spec.recompute

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if self.recompute else layer(x, cos, sin)
        return x


class UlyssesGPT(nn.Module):
    """This rank's share of a sequence in, its tokens' losses out ([b, s / SP], fp32)."""

    def __init__(self, init: Init, spec: BenchSpec, sp_group):
        super().__init__()
        self.head_dim = spec.hidden // spec.heads
        self.embedding = Embedding(init)
        self.decoder = Decoder(init, spec, sp_group)
        self.final_layernorm = nn.LayerNorm(spec.hidden, eps=NORM_EPS)
        self.output_layer = OutputLayer()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(positions, self.head_dim)
        x = self.decoder(self.embedding(tokens), cos, sin)
        logits = self.output_layer(self.final_layernorm(x), self.embedding.word_embeddings.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def build(spec: BenchSpec, mesh: SequenceParallelMesh, config: dict) -> UlyssesGPT:
    if spec.heads % mesh.sp:
        raise ValueError(f"DeepSpeed-Ulysses splits the attention heads over the sequence-parallel ranks: {spec.heads} "
                         f"heads are not divisible by {mesh.sp}")
    if spec.seq % mesh.sp:
        raise ValueError(f"sequence {spec.seq} is not divisible by the sequence-parallel size {mesh.sp}")
    init = our_initial_values(spec)
    with deepspeed.zero.Init(config_dict_or_path=config, mpu=mesh):
        model = UlyssesGPT(init, spec, mesh.sp_group)
    deepspeed.zero.register_external_parameter(model.output_layer, model.embedding.word_embeddings.weight)
    return model


def train(spec: BenchSpec, system: str, out_dir: str, sp: int | None, rss: PeakRss) -> None:
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the group above
    torch.set_num_threads(spec.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = SequenceParallelMesh(sp or world)
    gas = spec.grad_accumulation(mesh.dp)  # the global batch counts sequences, one replica per SP group
    config = spec.ds_config(mesh.dp, offload=False)
    start = time.perf_counter()
    model = build(spec, mesh, config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, spec.weight_decay),
                                      config=config, mpu=mesh)
    setup_s = time.perf_counter() - start
    tokens = synthetic_tokens(spec)  # [steps, global batch, seq + 1], the trainer's samples in its order
    local = spec.seq // mesh.sp
    first = mesh.sp_rank * local
    positions = torch.arange(first, first + local).expand(spec.micro_batch, local)
    timed = spec.warmup + spec.steps
    step_s, losses = [], []
    partial = os.path.join(out_dir, f"partial_rank{rank}.json")
    for s in range(timed):
        t0 = time.perf_counter()
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(gas):
            if engine.is_gradient_accumulation_boundary() != (m == gas - 1):
                raise RuntimeError(f"DeepSpeed's accumulation boundary (micro step {engine.micro_steps}) is not the "
                                   f"last micro-batch ({m + 1} of {gas}); check gradient_accumulation_steps")
            row = (m * mesh.dp + mesh.dp_rank) * spec.micro_batch
            batch = tokens[s, row:row + spec.micro_batch]
            inputs, labels = batch[:, :-1][:, first:first + local], batch[:, 1:][:, first:first + local]
            token_loss = engine(inputs, positions, labels)
            local_sum = token_loss.sum()
            # DeepSpeed sums the sequence-parallel ranks' gradients: their losses must add up to the mean.
            engine.backward(local_sum / token_loss.new_tensor(spec.micro_batch * spec.seq))
            engine.step()
            total += local_sum.detach().double()
        dist.all_reduce(total)  # every token of the global batch; also lines the ranks up for timing
        losses.append(total.item() / (spec.global_batch * spec.seq))
        step_s.append(time.perf_counter() - t0)
        peak = max(rss.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        with open(partial, "w", encoding="utf-8") as f:
            json.dump({"step_s": step_s, "losses": losses, "peak_rss": peak}, f)
        if rank == 0:
            print(f"[{system}] step {s + 1}/{timed}: loss {losses[-1]:.6f}, {step_s[-1]:.2f} s, "
                  f"{spec.global_batch * spec.seq / step_s[-1]:.1f} tokens/s, peak RSS {peak / 2**30:.2f} GiB",
                  flush=True)
    dist.barrier()
    peak = max(rss.stop(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result = {"system": system, "rank": rank, "world": world, "sp": mesh.sp, "setup_s": setup_s, "step_s": step_s,
              "losses": losses, "peak_rss": peak, "threads": torch.get_num_threads()}
    with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    rss = PeakRss()  # first, so the peak covers imports, model build and engine set-up too
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", required=True, help="row name in the table (for the log lines)")
    p.add_argument("--spec", required=True, help="BenchSpec JSON written by the driver")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--sp", type=int, help="sequence-parallel size (default: every rank)")
    a = p.parse_args()
    rank = os.environ.get("RANK", "0")
    try:
        train(BenchSpec.load(a.spec), a.system, a.out_dir, a.sp, rss)
    except BaseException as e:
        write_error(a.out_dir, rank, e)
        raise


if __name__ == "__main__":
    main()
