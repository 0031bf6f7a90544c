"""The plain data-parallel backend's model states behind zero_cache's checkpoint interface.

Every data-parallel rank holds whole (tensor/pipeline-local) parameters, their fp32 main copies and torch
AdamW's state; each parameter is one ``StatePiece``. The replicas declare the same chunks, and the checkpoint
keeps one copy of each (written by whichever rank has the least to write).
"""
from __future__ import annotations

import torch

from megatron.core.optimizer import MegatronOptimizer
from zero_cache.checkpoint.interface import PARAM, StatePiece


class DataParallelStates:
    """A ``zero_cache.checkpoint.interface.StateSource`` over ``model`` and its ``MegatronOptimizer``."""

    def __init__(self, model: torch.nn.Module, optimizer: MegatronOptimizer):
        self.model, self.optimizer = model, optimizer
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def _flat(self, piece: StatePiece, state: str) -> torch.Tensor:
        main = self.optimizer.main_param(self._params[piece.name])
        t = main if state == PARAM else self.optimizer.adam_state(main)[state]
        return t.detach().view(-1)

    def state_pieces(self) -> list[StatePiece]:
        return [StatePiece(n, tuple(p.shape), 0, p.numel()) for n, p in self._params.items()]

    def read_state(self, piece: StatePiece, state: str, lo: int, hi: int) -> torch.Tensor:
        return self._flat(piece, state)[lo:hi]

    def write_state(self, piece: StatePiece, state: str, lo: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            self._flat(piece, state)[lo:lo + values.numel()].copy_(values.reshape(-1))

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        persistent = self.model.state_dict(keep_vars=True)
        trained = {id(p) for p in self._params.values()}
        return {n: t for n, t in persistent.items() if id(t) not in trained}

    def training_state(self) -> dict:
        steps = {float(self.optimizer.adam_state(self.optimizer.main_param(p))["step"])
                 for p in self._params.values()}
        if len(steps) != 1:
            raise RuntimeError(f"the parameters disagree on AdamW's step count ({sorted(steps)})")
        return {"optimizer_step": int(steps.pop()), "loss_scaler": self.optimizer.loss_scaler_state()}

    def load_training_state(self, state: dict, load_optimizer: bool) -> None:
        if not load_optimizer:
            return
        with torch.no_grad():
            for p in self._params.values():
                self.optimizer.adam_state(self.optimizer.main_param(p))["step"].fill_(float(state["optimizer_step"]))
        self.optimizer.load_loss_scaler_state(state.get("loss_scaler"))

    def states_loaded(self) -> None:
        self.optimizer.main_params_changed()
