"""Pre-train a GPT model. Megatron-LM's flags; launch with torchrun (or plain python for one process).

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 12 ...
"""
from __future__ import annotations

from functools import partial

import torch

from megatron.core.tensor_parallel import RNGStatesTracker
from megatron.core.transformer_config import TransformerConfig
from megatron.data import build_train_valid_test_datasets, get_ltor_masks_and_position_ids
from megatron.data.errors import check_token_ids
from megatron.model.gpt_model import GPTModel
from megatron.training.arguments import parse_args
from megatron.training.config import Config
from megatron.training.errors import exit_with, run_trainer
from megatron.training.training import TrainResult, pretrain


def model_provider(config: TransformerConfig, rng_tracker: RNGStatesTracker) -> GPTModel:
    return GPTModel(config, rng_tracker=rng_tracker)


def datasets_provider(cfg: Config, tokenizer, seq_length: int, num_samples: tuple[int, int, int]):
    return build_train_valid_test_datasets(cfg.data, tokenizer, seq_length, num_samples, cfg.train.seed,
                                           vocab_size=tokenizer.vocab_size)


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Mean loss over the tokens that count (all but masked EOD positions)."""
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(per_token_loss.reshape(-1).float() * loss_mask) / loss_mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach()}


def forward_step(cfg: Config, eod: int, vocab_size: int, device: torch.device, data_iterator, model):
    text = next(data_iterator)["text"]
    check_token_ids(text, vocab_size, cfg.data)
    # One asynchronous copy of the batch (the data loader pins it on a GPU machine), widened and split there.
    text = text.to(device, non_blocking=True).long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    d = cfg.data
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def forward_step_provider(cfg: Config, tokenizer, device: torch.device):
    return partial(forward_step, cfg, tokenizer.eod, tokenizer.vocab_size, device)


def main(argv: list[str] | None = None) -> TrainResult:
    """Bad input (flags, configs, data, checkpoints, SSD tier) is one line on stderr and exit code 2; a rank
    stopped by another rank's failure says so in one line, exit code 1 (megatron/training/errors.py)."""
    return run_trainer(lambda: pretrain(parse_args(argv), model_provider, datasets_provider, forward_step_provider))


if __name__ == "__main__":
    exit_with(main)
