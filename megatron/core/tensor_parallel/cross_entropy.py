"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor):
        group = ps.get_tensor_model_parallel_group()
        world = ps.get_tensor_model_parallel_world_size()
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        # Subtract the global max for stability.
        logits_max = logits.max(dim=-1)[0]
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)

        part = logits.shape[-1]
        start = ps.get_tensor_model_parallel_rank() * part
        in_range = (target >= start) & (target < start + part)
        local_target = torch.where(in_range, target - start, torch.zeros_like(target))
        flat = logits.view(-1, part)
        rows = torch.arange(flat.shape[0], device=flat.device)
        target_logit = flat[rows, local_target.view(-1)].view_as(target)
        target_logit = torch.where(in_range, target_logit, torch.zeros_like(target_logit))

        exp_logits = logits.exp()
        sum_exp = exp_logits.sum(dim=-1)
        if world > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, in_range, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_range, local_target = ctx.saved_tensors
        grad = softmax  # reuse the buffer: d loss / d logits = softmax - onehot
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local_target.view(-1)] -= in_range.view(-1).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss [..] for logits [.., vocab / tp] split over the tensor-parallel group (fp32 math)."""
    return _VocabParallelCrossEntropy.apply(logits, target)
