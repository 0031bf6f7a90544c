"""What every update strategy does; the waiting step is the reference the others must equal."""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..lifecycle import ChunkListener
from ..optimizer import ShardedAdam, SwapStats
from ..param_refresh import ParamRefresh
from ..speculation import SpeculationStats


class UpdateStrategy(ChunkListener, ABC):
    """Runs the optimizer's update of one step. The engine calls, in a step: ``join`` (any update still
    running from the last step is finished), ``prepare`` (before the gradient norm), then ``apply`` or, when
    the gradients overflowed, ``skip``. It also hears the chunk lifecycle (lifecycle.py)."""

    def __init__(self, optimizer: ShardedAdam, refresh: ParamRefresh):
        self.optimizer = optimizer
        self.refresh = refresh

    def backward_started(self) -> None:
        """A backward pass began: SSD states may be read ahead under it."""
        self.optimizer.start_read_ahead(during_backward=True)

    def prepare(self) -> None:
        """Before the norm: the first SSD sub-group loads while it is computed."""
        self.optimizer.start_read_ahead()

    @abstractmethod
    def apply(self, grad_scale: float, unclipped: bool) -> int:
        """Update every shard, gradients divided by ``grad_scale`` inside the kernel (``unclipped``: the clip
        coefficient is exactly 1). Returns how many times the resident chunks were all-gathered (0 or 1)."""

    def skip(self) -> None:
        """The step overflowed: nothing is updated; reads started for it are handed back."""
        self.optimizer.drop_read_ahead()

    def join(self) -> str | None:
        """Finish an update still running under this step's compute; what it did (None: nothing ran)."""
        return None

    def in_flight(self) -> bool:
        """An update runs (or ran and was not joined yet) under the training thread's compute."""
        return False

    def finish(self) -> None:
        """Finish the last step's update wherever it runs, so that every state is final."""
        self.join()

    def step_swap_stats(self) -> SwapStats | None:
        """The SSD traffic the step itself just did (None: none, or it is reported when the update ends)."""
        return self.optimizer.last_swap

    def take_speculation_stats(self) -> SpeculationStats | None:
        return None

    def close(self) -> None:  # noqa: B027 (only strategies with threads have something to close)
        pass
