"""Where the log's scalars go besides the log line: TensorBoard (``--tensorboard-dir``) and Weights & Biases
(``--wandb-project``), behind one ``write(scalars, step)``.

Both are written by the logging rank only (the last rank, as in Megatron-LM). wandb is an optional
dependency, imported only when ``--wandb-project`` is given (``parse_args`` has checked that it is installed).
"""
from __future__ import annotations

import os
from typing import Any, Protocol


class ScalarWriter(Protocol):
    def write(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    def __init__(self, log_dir: str, max_queue: int = 1000):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, project: str, name: str, save_dir: str | None, entity: str | None, config: dict[str, Any]):
        import wandb
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, entity=entity, config=config)

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
