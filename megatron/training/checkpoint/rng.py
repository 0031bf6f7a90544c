"""RNG states and plain values in checkpoints: what ``torch.load(..., weights_only=True)`` can read back."""
from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import torch

from zero_cache.checkpoint import CheckpointError


def to_plain(obj: Any, where: str = "state") -> Any:
    """Convert numpy values to tensors / Python numbers and reject anything weights_only=True cannot load."""
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (torch.dtype, torch.Size, torch.device)):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = to_plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return (list if isinstance(obj, list) else tuple)(to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise CheckpointError(f"{where} is a {type(obj).__name__}, which torch.load(weights_only=True) cannot read; "
                          "store tensors, numbers, strings, lists or dicts instead")


def get_rng_state(rng_tracker=None) -> dict:
    np_state = np.random.get_state()
    state = {
        "random_rng_state": list(random.getstate()),
        "np_rng_state": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                         int(np_state[3]), float(np_state[4])],
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": rng_tracker.get_states() if rng_tracker is not None else {},
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, rng_tracker=None) -> None:
    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if rng_tracker is not None:
        rng_tracker.set_states(state["rng_tracker_states"])
