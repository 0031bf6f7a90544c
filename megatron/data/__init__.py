"""GPT pre-training data: Megatron's indexed datasets, sample indices, blending and data loading.

The config (``DataConfig``, ``parse_blend``) and the indexed dataset need only numpy, so preprocessing
tools import them without torch; the torch-based parts load on first use.
"""
from importlib import import_module

from megatron.data.config import DataConfig, parse_blend
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, best_fitting_dtype

_LAZY = {
    "build_train_valid_test_datasets": "megatron.data.dataset_builder",
    "build_pretraining_data_loader": "megatron.data.data_samplers",
    "MegatronPretrainingSampler": "megatron.data.data_samplers",
    "get_ltor_masks_and_position_ids": "megatron.data.masks",
    "GPTDataset": "megatron.data.gpt_dataset",
    "BlendableDataset": "megatron.data.blendable_dataset",
    "MockGPTDataset": "megatron.data.mock_dataset",
}

__all__ = ["DataConfig", "parse_blend", "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "best_fitting_dtype",
           *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron.data' has no attribute {name!r}")
