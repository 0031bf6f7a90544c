"""Tiny random Hugging Face models for the conversion tests: built from a config, every weight perturbed, saved;
the token batch and logits the tests compare."""
from __future__ import annotations

from typing import Callable

import torch
from transformers import AutoModelForCausalLM

VOCAB, SEQ = 100, 16


def random_hf_model(config, path: str, noise: Callable[[str], float] = lambda name: 0.05, **save):
    """``config``'s model with ``noise(name)`` x N(0, 1) added to every parameter (biases and norms included),
    saved at ``path`` (``save``: extra ``save_pretrained`` arguments)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(noise(name) * torch.randn_like(p))
    model.save_pretrained(path, **save)
    return model


def hf_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(hf_tokens()).logits
