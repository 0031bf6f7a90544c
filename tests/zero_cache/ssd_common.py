"""A deep residual model whose ZeRO-3 states live on SSD beyond a small host budget (checkpoint tests)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zero_cache

WIDTH, VOCAB, SEQ, BATCH = 256, 64, 8, 8
SLICE = 32_768  # save_large_model_slice_size: elements of each state per slice file (128 KiB fp32)
BLOCK = 65_536  # aio.block_size: the SSD piece that range reads and writes stage through
HOST_BUDGET = 3_400_000  # bytes: gradient shards + SSD staging fit, the rank's states do not (several times)


class Deep(nn.Module):
    """Residual stack of square layers: many equal shards, biases small enough to stay resident."""

    def __init__(self, depth: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def ssd_config(nvme: str, **zero) -> dict:
    z = {"stage": 3, "allgather_bucket_size": 70_000, "sub_group_size": 40_000, "pipeline_optimizer": False,
         "stage3_param_persistence_threshold": 300, "stage3_prefetch_bucket_size": 0,
         "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
         "offload_param": {"device": "nvme", "nvme_path": nvme},
         "memory_budget": {"host": HOST_BUDGET}, "save_large_model_slice_size": SLICE, **zero}
    return {"train_batch_size": BATCH, "gradient_clipping": 1.0, "aio": {"block_size": BLOCK},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}, "zero_optimization": z}


def ssd_engine(nvme: str, seed: int, depth: int = 16, **zero):
    torch.manual_seed(seed)
    return zero_cache.initialize(model=Deep(depth), config=ssd_config(nvme, **zero))


def ssd_data(steps: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


def ssd_train(engine, data, rank: int, dp: int, steps) -> list[float]:
    losses = []
    per = BATCH // dp
    for s in steps:
        loss = engine(data[s][rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


