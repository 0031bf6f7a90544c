"""Shared pieces of the CUDA tests: the zero_cache tests' tiny model and fp32 reference (tests/zero_cache/common.py)
on a GPU, the skip rule, engines on a device, a way to keep a stream busy, and a counter of host synchronisations.

Nothing here touches CUDA at import: the modules are collected (and skipped) on machines without a GPU, and
tests/tools/test_cuda_suite_collection.py checks that they would all run on one."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import zero_cache
from tests.zero_cache.common import BETAS, CLIP, EPS, LR, WD, TinyGPT, batches, ds_config, make_model

CUDA = torch.device("cuda", 0)
STEPS = 5
# Final weights after STEPS AdamW steps: host sub-groups (CPU fused Adam) against the reference's CUDA Adam.
WEIGHT_TOL = 1e-4
NO_GPU = "needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)"


def gpu_only() -> list:
    """Every test module's ``pytestmark``: selected by -m cuda, skipped (with NO_GPU) where torch sees no GPU.
    Called at the module's import, so the condition is decided when the module is collected, never later."""
    return [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]


def strict_fp32() -> None:
    """fp32 matmuls without TF32, so that the engine and the reference compute the same thing (the models
    have no convolutions, so cuDNN's flag does not matter). A process of its own calls it again."""
    torch.backends.cuda.matmul.allow_tf32 = False


def make_device_model(device: torch.device, seed: int = 0) -> TinyGPT:
    """common.make_model's model, with the same initial weights, on ``device``."""
    return make_model(seed).to(device)


def device_reference(device: torch.device, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process fp32 on ``device``: the model and torch AdamW on each whole global batch.

    Returns the loss of every step and the final weights (CPU copies)."""
    model = make_device_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = batches(steps).to(device)
    losses = []
    for s in range(steps):
        loss = model(data[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def offload_config(pinned: bool = True, **zero) -> dict:
    """Stage 3, parameters and optimizer states in host memory (pinned unless told otherwise)."""
    cfg = ds_config(3, 1, offload=True, **zero)
    for key in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][key]["pin_memory"] = pinned
    return cfg


def device_engine(config: dict, device: torch.device = CUDA, tied_group=None, **kw):
    """(model, engine): the tiny model on ``device`` in an engine; the head uses the embedding weight, tied
    across ``tied_group`` when one is given."""
    model = make_device_model(device)
    tied = [(model.embed.weight, tied_group)] if tied_group is not None else None
    engine = zero_cache.initialize(model=model, config=config, tied_param_groups=tied, **kw)
    engine.register_external_parameter(model.head, model.embed.weight)
    return model, engine


def busy(seconds: float) -> None:
    """Queue a kernel that spins for at least ``seconds`` on the current stream (at most 2 GHz of clock), so
    that work queued behind it, or waiting for it, is still pending while the host goes on."""
    torch.cuda._sleep(int(seconds * 2e9))


class SyncCounter:
    """The host synchronisations CUDA work makes, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them:
    ``.item()``, ``.tolist()``, a blocking copy to or from the device (``torch.tensor(x, device=cuda)``, ``.to``,
    ``.cpu()``), ``torch.cuda.synchronize()`` and the like. Event and stream waits (``Event.synchronize``) are not
    reported by torch, so they are not counted here.

    Each one is recorded as (phase, thread name, "file:line" of the Python line that called it); ``phase`` is
    whatever the test set last. Warnings of any thread land here: torch raises them in the thread that ran the
    op, and replays those of the autograd engine's threads in the thread that called backward."""

    MESSAGE = "synchronizing CUDA operation"

    def __init__(self):
        self.phase = ""
        self.records: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "SyncCounter":
        self._mode = torch.cuda.get_sync_debug_mode()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")  # every occurrence, not once per line
        warnings.showwarning = self._show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(*exc)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self.MESSAGE in str(message):
            with self._lock:
                self.records.append((self.phase, threading.current_thread().name, f"{filename}:{lineno}"))

    def clear(self) -> None:
        with self._lock:
            self.records.clear()

    def of(self, phase: str) -> list[tuple[str, str, str]]:
        with self._lock:
            return [r for r in self.records if r[0] == phase]
