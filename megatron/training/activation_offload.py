"""The trainer's ``--cpu-offloading``: one activation offloader (zero_cache/activation_offload.py) on the copy
streams the backend already runs (the ZeRO engine's) or on the device's own, given to every model chunk, and
drained after each step for the log line."""
from __future__ import annotations

import torch

from megatron.training.backends.base import Backend
from zero_cache.activation_offload import ActivationOffloader, ActivationOffloadStats
from zero_cache.streams import device_copy_streams


class TrainerActivationOffload:
    def __init__(self, model: torch.nn.Module, backend: Backend, device: torch.device):
        shared = backend.shared_copy_streams()
        # Streams made here are ours to drain each step (CUDA streams keep every copy's timing events till then).
        self._own_streams = None if shared is not None else device_copy_streams(device)
        self.offloader = ActivationOffloader(shared if shared is not None else self._own_streams)
        model.set_activation_offloader(self.offloader)

    @property
    def moves_anything(self) -> bool:
        """False without an accelerator: host and device are one memory, there is nowhere to move to."""
        return self.offloader.enabled

    def end_step(self) -> ActivationOffloadStats:
        """Retire the copies that landed and return the step's figures."""
        self.offloader.poll()
        if self._own_streams is not None:
            self._own_streams.take_stats()
        return self.offloader.take_stats()
