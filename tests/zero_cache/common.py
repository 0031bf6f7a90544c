"""Tiny transformer-ish model, data and the single-process fp32 reference shared by the zero_cache tests."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_cache
from zero_cache.weight_grad import embedding, linear

VOCAB, HIDDEN, SEQ, LAYERS = 64, 16, 8, 2
GLOBAL_BATCH, GAS, STEPS = 8, 2, 10
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 5.0


class FusedLinear(nn.Linear):
    """nn.Linear whose weight gradient goes to the engine's sink (zero_cache/weight_grad.py)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class FusedEmbedding(nn.Embedding):
    """nn.Embedding whose weight gradient goes to the engine's sink (zero_cache/weight_grad.py)."""

    def forward(self, ids):
        return embedding(ids, self.weight)


class Block(nn.Module):
    def __init__(self, fused: bool = False):
        super().__init__()
        make_linear = FusedLinear if fused else nn.Linear
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.fc1 = make_linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = make_linear(4 * HIDDEN, HIDDEN)
        self.gate = nn.Parameter(torch.ones(HIDDEN))  # a tiny parameter used directly by the block

    def forward(self, x):
        h = self.ln1(x)
        counts = torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device).view(1, -1, 1)
        mixed = h.cumsum(1) / counts  # causal mean
        return x + self.gate * self.fc2(torch.relu(self.fc1(h + mixed)))


class TiedHead(nn.Module):
    """Output projection with the (tied) word-embedding weight passed in, plus its own bias."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, x, weight):
        return F.linear(x, weight) + self.bias


class TinyGPT(nn.Module):
    def __init__(self, activation_checkpointing: bool = False, fused: bool = False):
        super().__init__()
        self.embed = (FusedEmbedding if fused else nn.Embedding)(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(fused) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = TiedHead()
        self.activation_checkpointing = activation_checkpointing

    def forward(self, tokens):
        x = self.embed(tokens[:, :-1])
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.activation_checkpointing else b(x)
        logits = self.head(self.ln_f(x), self.embed.weight)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw)


def make_engine(config: dict, seed: int = 0, **model_kw):
    """``make_model``'s model in a zero_cache engine, its tied head registered as a user of the embedding
    (the model is ``engine.module``)."""
    model = make_model(seed, **model_kw)
    engine = zero_cache.initialize(model=model, config=config)
    engine.register_external_parameter(model.head, model.embed.weight)
    return engine


def batches(steps: int = STEPS, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, SEQ + 1), generator=g)


def rank_micro_batches(step_batch: torch.Tensor, rank: int, dp: int, gas: int = GAS) -> list[torch.Tensor]:
    """This DP rank's slice of the global batch, split into ``gas`` micro-batches."""
    per_rank = step_batch.shape[0] // dp
    mine = step_batch[rank * per_rank:(rank + 1) * per_rank]
    return list(mine.chunk(gas))


def ds_config(stage: int, dp: int, offload: bool = False, **zero) -> dict:
    z = {"stage": stage, "allgather_bucket_size": 1100, "stage3_param_persistence_threshold": 100,
         "stage3_prefetch_bucket_size": 2200, "stage3_max_live_parameters": 100000,
         "stage3_max_reuse_distance": 0, "sub_group_size": 3000, "max_param_reduce_events": 1}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            z["offload_param"] = {"device": "cpu"}
    z.update(zero)
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WD}},
            "zero_optimization": z}


def train_engine(engine, data: torch.Tensor, rank: int, dp: int, steps=None, inject=None, norms=None) -> list[float]:
    """Run ``steps`` (indices into data) through the engine; return this rank's mean micro-batch loss per step.

    ``norms``, when a list, receives each step's StepResult.grad_norm."""
    losses = []
    for s in steps if steps is not None else range(data.shape[0]):
        micro = []
        for mb in rank_micro_batches(data[s], rank, dp):
            loss = engine(mb)
            micro.append(loss.item())
            if inject is not None:
                loss = inject(s, loss)
            engine.backward(loss)
        result = engine.step()
        if norms is not None:
            norms.append(result.grad_norm)
        losses.append(sum(micro) / len(micro))
    return losses


def reference_run(steps: int = STEPS, norms=None, adam=torch.optim.AdamW,
                  **model_kw) -> tuple[list[float], list[dict]]:
    """Single process fp32: plain model + torch AdamW (or ``adam``) on the whole global batch; returns losses
    and weights.

    ``norms``, when a list, receives each step's gradient norm before clipping."""
    model = make_model(**model_kw)
    opt = adam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = batches(steps)
    losses, weights = [], []
    for s in range(steps):
        loss = model(data[s])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if norms is not None:
            norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        weights.append(copy.deepcopy({k: v.detach().clone() for k, v in model.state_dict().items()}))
    return losses, weights


def assert_close_losses(got: list[float], ref: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= rel * abs(b), f"step {i + 1}: loss {a} vs reference {b} (rel {abs(a - b) / abs(b):.2e})"


def to_numpy(sd: dict) -> dict:
    """Tensors cannot leave a spawned rank through the result queue once it exits; numpy arrays can."""
    return {k: v.numpy() for k, v in sd.items()}


def assert_close_weights(got: dict, ref: dict, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert set(got) == set(ref), f"keys differ: {set(got) ^ set(ref)}"
    for k in ref:
        torch.testing.assert_close(torch.as_tensor(got[k]), ref[k], atol=atol, rtol=rtol,
                                   msg=lambda m, k=k: f"{k}: {m}")
