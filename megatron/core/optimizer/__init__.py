"""Optimizers, loss scaling and gradient clipping (Megatron-LM's ``megatron.core.optimizer``)."""
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    get_megatron_optimizer,
)

__all__ = [
    "OptimizerConfig", "ConstantGradScaler", "DynamicGradScaler", "get_grad_norm_fp32", "clip_grad_by_total_norm_fp32",
    "MegatronOptimizer", "FP32Optimizer", "Float16OptimizerWithFloat16Params", "get_megatron_optimizer",
]
