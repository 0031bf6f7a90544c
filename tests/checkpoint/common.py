"""Tiny GPT models for checkpoint tests, with weights and optimizer state that do not depend on the mesh.

Every parameter is overwritten with values drawn from a generator seeded by its
full (single-process) name, then sliced with the layer's own TP metadata, and
one AdamW step is taken with gradients built the same way. AdamW is elementwise,
so a TP=2 x PP=2 model and a single-process model end up with the same full
weights: the single-process model is the reference for reassembled checkpoints.
A mesh may add virtual pipeline stages, (TP, PP, v): each rank then builds the
``ModelChunks`` of its v chunks, whose parameter names start with ``chunks.<k>.``.
"""
from __future__ import annotations

import io
import os
import random
import re
import zlib

import numpy as np
import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel.model_chunks import ModelChunks
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.model.gpt_model import WORD_EMBEDDING, GPTModel, stage_layers
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.legacy import load_checkpoint, save_checkpoint

CONFIGS = {
    "gpt2": TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                              padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0),
    "llama": TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               seq_length=16, padded_vocab_size=64, ffn_hidden_size=48,
                               position_embedding_type="rope", rotary_base=5000.0, normalization="RMSNorm",
                               layernorm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
                               untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0),
}
MESHES = {"tp2pp2": (2, 2), "tp2dp2": (2, 1)}  # (TP, PP) on 4 ranks: DP = 1 and DP = 2


class StepCounter:
    """Stands in for OptimizerParamScheduler: state_dict / load_state_dict of a few plain values."""

    def __init__(self):
        self.num_steps, self.max_lr, self.decay_style = 0, 1e-2, "cosine"

    def step(self, n: int = 1) -> None:
        self.num_steps += n

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "decay_style": self.decay_style}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps, self.max_lr, self.decay_style = state["num_steps"], state["max_lr"], state["decay_style"]


def megatron_args(cfg: TransformerConfig, tp: int, pp: int, dp: int) -> dict:
    """The plain args dict the training loop stores (the keys convert_to_hf reads)."""
    keys = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "seq_length", "max_position_embeddings", "padded_vocab_size", "position_embedding_type",
            "normalization", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights",
            "layernorm_epsilon", "rotary_base"]
    out = {k: getattr(cfg, k) for k in keys}
    out.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
               group_query_attention=cfg.num_query_groups != cfg.num_attention_heads)
    return out


def _full_name(model: torch.nn.Module, name: str, param: torch.Tensor) -> str:
    if getattr(param, "shared", False):
        return WORD_EMBEDDING  # last stage's copy of the tied embedding
    chunk = re.match(r"^chunks\.(\d+)\.(.+)$", name)  # virtual pipeline stages: chunk k of this stage
    chunks, k, name = (len(model.chunks), int(chunk.group(1)), chunk.group(2)) if chunk else (1, 0, name)
    offset, _ = stage_layers(model.config.num_layers, ps.get_pipeline_model_parallel_world_size(),
                             ps.get_pipeline_model_parallel_rank(), chunks, k)
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{offset + int(m.group(1))}.", name)


def _mesh_independent(model: torch.nn.Module, name: str, param: torch.Tensor, salt: str, std: float,
                      mean: float = 0.0) -> torch.Tensor:
    """This rank's slice of a full tensor drawn from a generator seeded by the parameter's full name."""
    shape = list(param.shape)
    tp = ps.get_tensor_model_parallel_world_size()
    dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    if dim is not None:
        shape[dim] *= tp
    gen = torch.Generator().manual_seed(zlib.crc32((_full_name(model, name, param) + salt).encode()))
    full = mean + std * torch.randn(shape, generator=gen)
    return full if dim is None else full.chunk(tp, dim)[ps.get_tensor_model_parallel_rank()]


def build_model(cfg: TransformerConfig, rng_tracker=None, virtual_stages: int = 1) -> torch.nn.Module:
    """This rank's GPTModel stage, or the ModelChunks of its ``virtual_stages`` chunks."""
    if virtual_stages == 1:
        return GPTModel(cfg, rng_tracker=rng_tracker)
    return ModelChunks([GPTModel(cfg, rng_tracker=rng_tracker, virtual_stage=k, virtual_stages=virtual_stages)
                        for k in range(virtual_stages)])


def build_trained(cfg: TransformerConfig, rng_tracker=None, virtual_stages: int = 1
                  ) -> tuple[torch.nn.Module, torch.optim.AdamW, StepCounter]:
    """A model on the current mesh with random (nonzero) weights everywhere and one AdamW step taken."""
    model = build_model(cfg, rng_tracker, virtual_stages)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "layernorm" in name and name.endswith("weight")
            p.copy_(_mesh_independent(model, name, p, "", 0.1, 1.0 if is_norm else 0.0))
            p.grad = _mesh_independent(model, name, p, "/grad", 1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt.step()
    model.zero_grad(set_to_none=True)
    sched = StepCounter()
    sched.step(3)
    return model, opt, sched


def tokens(cfg: TransformerConfig, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.padded_vocab_size, (batch, cfg.seq_length), generator=torch.Generator().manual_seed(5))
    return ids, torch.arange(cfg.seq_length).expand(batch, -1)


def assert_same(a, b, where: str = "") -> None:
    """Exact equality of nested dicts / lists / tensors / scalars."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: tensors differ by {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ----- multi-process workers (module-level for run_distributed) -----
def pack(obj) -> bytes:
    """Results go back as bytes: tensors shared through the queue die with the worker process."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def draws(rng_tracker) -> list[torch.Tensor]:
    """The next values of every RNG a checkpoint restores: equal draws mean equal states."""
    out = [torch.tensor(random.random()), torch.from_numpy(np.random.rand(3)), torch.rand(3)]
    with rng_tracker.fork():
        out.append(torch.rand(3))
    return out


def save_worker(rank: int, world: int, root: str, meshes: dict[str, tuple[int, ...]]) -> bytes:
    """Under each (TP, PP) or (TP, PP, v) mesh, save both tiny models to ``root/<mesh>/<model>``; return what was
    saved."""
    out = {}
    for mesh, (tp, pp, *virtual) in meshes.items():
        ps.initialize_model_parallel(tp, pp)
        dp = ps.get_data_parallel_world_size()
        for name, cfg in CONFIGS.items():
            model, opt, sched = build_trained(cfg, virtual_stages=virtual[0] if virtual else 1)
            tracker = model_parallel_manual_seed(100 + rank)
            random.seed(rank)  # every rank's RNG differs, so each must get its own back
            np.random.seed(rank)
            torch.manual_seed(1000 + rank)
            cfg_ckpt = CheckpointConfig(save=os.path.join(root, mesh, name), load=None, save_interval=None)
            save_checkpoint(cfg_ckpt, 3, model, opt, sched, consumed_samples=48, args=megatron_args(cfg, tp, pp, dp),
                            rng_tracker=tracker)
            out[mesh, name] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                               "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                               "draws": draws(tracker)}
        ps.destroy_model_parallel()
    return pack(out)


def load_worker(rank: int, world: int, root: str, meshes: dict[str, tuple[int, ...]]) -> bytes:
    """Load every checkpoint of :func:`save_worker` into fresh models, optimizers and RNGs."""
    out = {}
    for mesh, (tp, pp, *virtual) in meshes.items():
        ps.initialize_model_parallel(tp, pp)
        for name, cfg in CONFIGS.items():
            model = build_model(cfg, virtual_stages=virtual[0] if virtual else 1)
            opt = torch.optim.AdamW(model.parameters(), lr=0.5)
            sched = StepCounter()
            tracker = model_parallel_manual_seed(7)
            random.seed(99)
            np.random.seed(99)
            torch.manual_seed(99)
            cfg_ckpt = CheckpointConfig(save=None, load=os.path.join(root, mesh, name), save_interval=None)
            iteration, consumed = load_checkpoint(cfg_ckpt, model, opt, sched, tracker)
            out[mesh, name] = {"iteration": iteration, "consumed": consumed,
                               "model": {k: v.clone() for k, v in model.state_dict().items()},
                               "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                               "draws": draws(tracker)}
        ps.destroy_model_parallel()
    return pack(out)
