"""The trainer's backends and the choice between them: the zero_cache engine when the run has an engine config
(``--deepspeed`` with ZeRO stage >= 1, ``--use-distributed-optimizer``; ``zero.py``), else Megatron's DDP +
optimizer (``ddp.py``); both implement ``base.Backend``."""
from __future__ import annotations

import torch

from megatron.core.pipeline_parallel.model_chunks import ModelChunks
from megatron.training.backends.base import Backend
from megatron.training.backends.ddp import MegatronBackend
from megatron.training.backends.zero import ZeroBackend, build_lazy_model
from megatron.training.compile import compile_blocks
from megatron.training.config import Config


def build_model(cfg: Config, model_provider, model_cfg, rng_tracker, device: torch.device) -> torch.nn.Module:
    """This stage's model on ``device``: ``model_provider(model_cfg, rng_tracker)``, or with the interleaved
    schedule a ``ModelChunks`` of its v chunks (``virtual_stage=k, virtual_stages=v``). For the engine it is built
    without memory and the engine fills it chunk by chunk (a model bigger than host memory can be trained), see
    zero.build_lazy_model."""
    v = cfg.parallel.virtual_stages

    def build() -> torch.nn.Module:
        if v == 1:
            return model_provider(model_cfg, rng_tracker)
        return ModelChunks([model_provider(model_cfg, rng_tracker, virtual_stage=k, virtual_stages=v)
                            for k in range(v)])

    model = build_lazy_model(build, device) if cfg.zero_cache is not None else build().to(device)
    if cfg.model.compile:
        compile_blocks(model)
    return model


def build_backend(cfg: Config, model: torch.nn.Module) -> Backend:
    """The zero_cache engine when the run has its config, else Megatron's DDP + optimizer."""
    if cfg.zero_cache is not None:
        return ZeroBackend(cfg, model)
    return MegatronBackend(cfg, model)
