"""Megatron's optimizer wrappers around torch AdamW: fp32, and 16-bit params with fp32 master weights.

Both take gradients from the data-parallel wrapper's buffer (already averaged
over data-parallel ranks), clip them by the global L2 norm over the
model-parallel group and step AdamW. ``step()`` returns
``(update_successful, grad_norm, num_zeros_in_grad)`` as Megatron does.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.data_parallel import is_expert_param
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, grad_sum_of_squares
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.tensor_parallel import param_is_tensor_parallel_duplicate

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


def _counted_in_grad_norm(param: nn.Parameter) -> bool:
    """Each gradient element is counted once: skip tied copies and tensor-parallel replicas."""
    if getattr(param, "shared", False):
        return False
    return not (ps.model_parallel_is_initialized() and param_is_tensor_parallel_duplicate(param))


def _param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; biases and norm weights (1-D) are not decayed."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0}]
    return [g for g in groups if g["params"]]


def _adamw(groups: list[dict], config: OptimizerConfig) -> tuple[torch.optim.AdamW, bool]:
    """torch's fused AdamW where the device has the kernel, else the multi-tensor (foreach) one."""
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                  weight_decay=config.weight_decay)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs), True
    except RuntimeError:  # raised by torch for a device without the fused kernel
        return torch.optim.AdamW(groups, foreach=True, **kwargs), False


class MegatronOptimizer:
    """What both implementations share: parameter groups, learning rate, norm and clipping."""

    def __init__(self, config: OptimizerConfig, model_chunks: list[nn.Module], main_params: list[nn.Parameter],
                 model_params: list[nn.Parameter], model_parallel_group: dist.ProcessGroup | None,
                 expert_model_parallel_group: dist.ProcessGroup | None = None):
        self.config = config
        self.model_chunks = model_chunks
        self.model_parallel_group = model_parallel_group
        # tp x pp x ep: the ranks over which expert gradients (different experts on every EP rank) are summed
        self.expert_model_parallel_group = expert_model_parallel_group
        self.device = main_params[0].device
        self.optimizer, self._fused = _adamw(_param_groups(main_params, config.weight_decay), config)
        counted = [(main, model) for main, model in zip(main_params, model_params) if _counted_in_grad_norm(model)]
        # Without an expert group every rank holds every expert: they count with the dense weights.
        apart = expert_model_parallel_group is not None
        self._norm_params = [main for main, model in counted if not (apart and is_expert_param(model))]
        self._expert_norm_params = [main for main, model in counted if apart and is_expert_param(model)]
        self._main_params = main_params

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def get_loss_scale(self) -> float:
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale()

    def zero_grad(self) -> None:
        """Zero the data-parallel grad buffers; drop any gradient that does not live in one."""
        for chunk in self.model_chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.zero_grad_buffer()
        for chunk in self.model_chunks:
            for p in chunk.parameters():
                if not hasattr(p, "main_grad"):
                    p.grad = None

    def _clip_and_step(self) -> tuple[bool, float]:
        """Global norm, clipping, AdamW step; a non-finite norm skips the update instead of poisoning weights."""
        grads = [p.grad for p in self._norm_params if p.grad is not None]
        squares = grad_sum_of_squares(grads, self.model_parallel_group, self.device)
        if self.expert_model_parallel_group is not None:
            expert_grads = [p.grad for p in self._expert_norm_params if p.grad is not None]
            squares += grad_sum_of_squares(expert_grads, self.expert_model_parallel_group, self.device)
        grad_norm = squares ** 0.5
        if not math.isfinite(grad_norm):
            return False, grad_norm
        if self.config.clip_grad > 0:
            clip_grad_by_total_norm_fp32(self._main_params, self.config.clip_grad, grad_norm)
        self.optimizer.step()
        return True, grad_norm

    # ---- checkpoint access: the fp32 copy each parameter is optimised as, and its Adam state ----
    def main_param(self, model_param: nn.Parameter) -> nn.Parameter:
        """The fp32 tensor AdamW updates for ``model_param`` (itself unless it is 16-bit)."""
        return model_param

    def adam_state(self, main_param: nn.Parameter) -> dict[str, torch.Tensor]:
        """AdamW's state of ``main_param`` (step, exp_avg, exp_avg_sq), created as torch creates it (zeros)
        when no step has run yet, so a checkpoint can be loaded into a fresh optimizer."""
        state = self.optimizer.state[main_param]
        if not state:
            group = next(g for g in self.optimizer.param_groups if any(p is main_param for p in g["params"]))
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = (torch.zeros((), dtype=torch.float32, device=main_param.device) if on_device
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(main_param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(main_param, memory_format=torch.preserve_format)
        return state

    def loss_scaler_state(self) -> dict | None:
        """The dynamic loss scaler's state (None without one)."""
        return None

    def load_loss_scaler_state(self, state: dict | None) -> None:
        """Restore ``loss_scaler_state``."""

    def main_params_changed(self) -> None:
        """The fp32 copies were overwritten (checkpoint load): refresh the model's own parameters."""

    def _load_torch_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:  # kernel choice belongs to this machine, not the checkpoint
            group["fused"], group["foreach"] = self._fused, not self._fused


class FP32Optimizer(MegatronOptimizer):
    """fp32 parameters: AdamW updates them directly (no master copy); grads are the DDP buffer views."""

    def __init__(self, config: OptimizerConfig, model_chunks: list[nn.Module], params: list[nn.Parameter],
                 model_parallel_group: dist.ProcessGroup | None,
                 expert_model_parallel_group: dist.ProcessGroup | None = None):
        super().__init__(config, model_chunks, params, params, model_parallel_group, expert_model_parallel_group)

    def step(self) -> tuple[bool, float | None, None]:
        ok, grad_norm = self._clip_and_step()
        return ok, grad_norm, None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._load_torch_optimizer_state(state)


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16/fp16 parameters with fp32 master copies that own the AdamW state.

    Gradients come from ``param.main_grad`` (filled by DistributedDataParallel).
    fp16 scales the loss (constant or dynamic scale); an overflow anywhere in the
    model-parallel group skips the step on every rank and lowers the scale.
    bf16 needs no scaling. fp32 parameters in the model are updated directly.
    """

    def __init__(self, config: OptimizerConfig, model_chunks: list[nn.Module], params: list[nn.Parameter],
                 model_parallel_group: dist.ProcessGroup | None,
                 expert_model_parallel_group: dist.ProcessGroup | None = None):
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (16-bit model param, fp32 master)
        main_params = []
        for p in params:
            if p.dtype in _HALF:
                master = nn.Parameter(p.detach().float())
                self._pairs.append((p, master))
                main_params.append(master)
            else:
                main_params.append(p)
        super().__init__(config, model_chunks, main_params, params, model_parallel_group,
                         expert_model_parallel_group)
        self._master_of = {id(p): m for p, m in self._pairs}
        self.grad_scaler: ConstantGradScaler | DynamicGradScaler | None = None
        if config.fp16:
            self.grad_scaler = (ConstantGradScaler(config.loss_scale) if config.loss_scale is not None else
                                DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                                  growth_interval=config.loss_scale_window,
                                                  hysteresis=config.hysteresis))

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def main_param(self, model_param: nn.Parameter) -> nn.Parameter:
        return self._master_of.get(id(model_param), model_param)

    def loss_scaler_state(self) -> dict | None:
        if isinstance(self.grad_scaler, DynamicGradScaler):
            return self.grad_scaler.state_dict()
        return None

    def load_loss_scaler_state(self, state: dict | None) -> None:
        if state is not None and isinstance(self.grad_scaler, DynamicGradScaler):
            self.grad_scaler.load_state_dict(state)

    def main_params_changed(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])

    def _unscale_and_check_overflow(self) -> bool:
        """Divide the grads by the loss scale in place; True if any rank of the model has an inf/nan."""
        grads = [p.grad for p in self._main_params if p.grad is not None]
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        if grads:
            inv_scale = torch.full((1,), self.grad_scaler.inv_scale, dtype=torch.float32, device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        # Grads are identical across data-parallel ranks already; model-parallel ranks must agree to skip.
        for group in (self.model_parallel_group, self.expert_model_parallel_group):  # experts differ across EP
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return bool(found_inf.item() > 0)

    def step(self) -> tuple[bool, float | None, None]:
        for model_param, master in self._pairs:
            master.grad = model_param.main_grad.float()  # the buffer view itself when the buffer is fp32
        try:
            if self.grad_scaler is not None:
                found_inf = self._unscale_and_check_overflow()
                self.grad_scaler.update(found_inf)
                if found_inf:
                    return False, None, None
            ok, grad_norm = self._clip_and_step()
            if ok:
                with torch.no_grad():
                    torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])
            return ok, grad_norm, None
        finally:
            for _, master in self._pairs:
                master.grad = None

    def state_dict(self) -> dict:
        masters = {id(m) for _, m in self._pairs}
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "fp32_from_fp16_params": [[p.detach() for p in g["params"] if id(p) in masters]
                                      for g in self.optimizer.param_groups],
        }

    def load_state_dict(self, state: dict) -> None:
        self._load_torch_optimizer_state(state["optimizer"])
        if self.grad_scaler is not None:
            if state.get("grad_scaler") is None:
                logger.warning("checkpoint has no loss-scaler state; starting from --initial-loss-scale")
            else:
                self.grad_scaler.load_state_dict(state["grad_scaler"])
        masters = {id(m) for _, m in self._pairs}
        saved = state["fp32_from_fp16_params"]
        current = [[p for p in g["params"] if id(p) in masters] for g in self.optimizer.param_groups]
        if [len(s) for s in saved] != [len(c) for c in current] or any(
                s.shape != c.shape for ss, cc in zip(saved, current) for s, c in zip(ss, cc)):
            raise ValueError("the checkpoint's fp32 master weights do not match this model (different model "
                             "size or parallel layout); load with --no-load-optim or the original settings")
        with torch.no_grad():
            for ss, cc in zip(saved, current):
                for s, c in zip(ss, cc):
                    c.copy_(s)


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list[nn.Module],
                           data_parallel_group: dist.ProcessGroup | None,
                           model_parallel_group: dist.ProcessGroup | None,
                           expert_model_parallel_group: dist.ProcessGroup | None = None) -> MegatronOptimizer:
    """Build the optimizer for this rank's model chunks (wrap them in DistributedDataParallel first).

    ``model_parallel_group`` (tensor x pipeline) is where the grad norm and the
    overflow flag are summed; None means a single process. Expert weights' squared
    norm is summed over ``expert_model_parallel_group`` (tensor x pipeline x expert)
    instead, when the model has experts.
    """
    params, seen = [], set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if not params:
        raise ValueError("the model chunks have no trainable parameters; nothing to optimize")
    dp_size = 1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
    half = {p.dtype for p in params if p.dtype in _HALF}
    unwrapped = [p for p in params if not hasattr(p, "main_grad")]
    if unwrapped and (dp_size > 1 or half):
        raise ValueError(f"{len(unwrapped)} parameters have no main_grad: wrap each model chunk in "
                         "megatron.core.distributed.DistributedDataParallel before building the optimizer "
                         "(it averages gradients over data-parallel ranks and keeps 16-bit grads in fp32)")
    if not (config.fp16 or config.bf16):
        if half:
            raise ValueError(f"parameters are {sorted(map(str, half))} but neither --fp16 nor --bf16 is set; "
                             "pass the flag matching the model's dtype")
        return FP32Optimizer(config, model_chunks, params, model_parallel_group, expert_model_parallel_group)
    wanted = torch.float16 if config.fp16 else torch.bfloat16
    if half - {wanted}:
        raise ValueError(f"--{'fp16' if config.fp16 else 'bf16'} is set but parameters are "
                         f"{sorted(map(str, half))}; build the model in {wanted}")
    return Float16OptimizerWithFloat16Params(config, model_chunks, params, model_parallel_group,
                                             expert_model_parallel_group)
