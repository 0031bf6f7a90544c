"""Pre-train a GPT model. Megatron-LM's flags; launch with torchrun (or plain python for one process).

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 12 ...
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.context_parallel import split_for_context_parallel
from megatron.core.tensor_parallel import RNGStatesTracker
from megatron.core.transformer_config import TransformerConfig
from megatron.data import build_train_valid_test_datasets, get_ltor_masks_and_position_ids
from megatron.data.errors import check_token_ids
from megatron.model.gpt_model import GPTModel
from megatron.training.arguments import parse_args
from megatron.training.config import Config
from megatron.training.errors import exit_with, run_trainer
from megatron.training.training import TrainResult, pretrain


def model_provider(config: TransformerConfig, rng_tracker: RNGStatesTracker, virtual_stage: int = 0,
                   virtual_stages: int = 1) -> GPTModel:
    """This pipeline stage's model, or its ``virtual_stage``-th chunk under the interleaved schedule."""
    return GPTModel(config, rng_tracker=rng_tracker, virtual_stage=virtual_stage, virtual_stages=virtual_stages)


def datasets_provider(cfg: Config, tokenizer, seq_length: int, num_samples: tuple[int, int, int]):
    return build_train_valid_test_datasets(cfg.data, tokenizer, seq_length, num_samples, cfg.train.seed,
                                           vocab_size=tokenizer.vocab_size)


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Mean loss over the tokens that count (all but masked EOD positions).

    With context parallelism each rank holds 1/CP of the tokens: it divides its sum by the count over the
    context-parallel group, and returns CP times that for backward, since gradients are averaged over the
    data x context-parallel ranks (Megatron's convention); the reported loss is the whole sequence's."""
    loss_mask = loss_mask.reshape(-1).float()
    local_sum = torch.sum(per_token_loss.reshape(-1).float() * loss_mask)
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        loss = local_sum / loss_mask.sum().clamp(min=1)
        return loss, {"lm loss": loss.detach()}
    group = ps.get_context_parallel_group()
    totals = torch.stack([local_sum.detach(), loss_mask.sum()])
    dist.all_reduce(totals, group=group)
    count = totals[1].clamp(min=1)
    return local_sum / count * cp, {"lm loss": totals[0] / count}


def split_for_this_context_parallel_rank(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each [b, s] tensor's two chunks this context-parallel rank holds (megatron/core/context_parallel/)."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return list(tensors)
    rank = ps.get_context_parallel_rank()
    return [None if t is None else split_for_context_parallel(t, 1, cp, rank) for t in tensors]


def forward_step(cfg: Config, eod: int, vocab_size: int, device: torch.device, data_iterator, model):
    text = next(data_iterator)["text"]
    check_token_ids(text, vocab_size, cfg.data)
    # One asynchronous copy of the batch (the data loader pins it on a GPU machine), widened and split there.
    text = text.to(device, non_blocking=True).long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    d = cfg.data
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)
    tokens, labels, loss_mask, position_ids = split_for_this_context_parallel_rank(
        tokens, labels, loss_mask, position_ids)
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
