"""Megatron's greedy blend: identical to its C++ loop, proportions within 1%, wired through the builder."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron.data import DataConfig, build_train_valid_test_datasets, parse_blend
from megatron.data.blendable_dataset import BlendableDataset, samples_per_dataset
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.index_builders import build_blending_indices
from megatron.training.arguments.data import add_data_args, data_config_from_args
from tests.data.common import make_dataset


def reference_blend(weights, size):
    """Megatron's helpers.cpp build_blending_indices, transcribed."""
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    current = [0] * len(weights)
    for i in range(size):
        step = max(float(i), 1.0)
        best, best_error = 0, weights[0] * step - float(current[0])
        for d in range(1, len(weights)):
            error = weights[d] * step - float(current[d])
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1 / 3, 1 / 3, 1 / 3], [0.05, 0.5, 0.25, 0.2], [1.0]])
def test_blend_equals_megatron_and_meets_weights(weights):
    weights = np.array(weights) / np.sum(weights)
    ours = build_blending_indices(weights, 20_000)
    index, sample = reference_blend(list(weights), 20_000)
    np.testing.assert_array_equal(ours["dataset_index"], index)
    np.testing.assert_array_equal(ours["dataset_sample_index"], sample)
    fractions = np.bincount(ours["dataset_index"], minlength=len(weights)) / 20_000
    assert np.all(np.abs(fractions - weights) <= 0.01 * weights)
    for d in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
        taken = ours["dataset_sample_index"][ours["dataset_index"] == d]
        np.testing.assert_array_equal(taken, np.arange(len(taken)))


def test_parse_blend():
    assert parse_blend(["A"], "--data-path") == ((1.0, "A"),)
    assert parse_blend(["0.3", "A", "0.7", "B"], "--data-path") == ((0.3, "A"), (0.7, "B"))
    assert parse_blend(["A", "B"], "--data-path") == ((1.0, "A"), (1.0, "B"))
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_blend(["0.3", "A", "B"], "--data-path")
    with pytest.raises(ValueError, match="positive sum"):
        parse_blend(["0", "A", "0", "B"], "--data-path")


def test_blended_datasets_from_data_path(tmp_path):
    for name, size, count, seed in (("a", 40, 200, 1), ("b", 25, 300, 2), ("c", 60, 100, 3)):
        make_dataset(tmp_path / name, [size] * count, seed=seed)
    cfg = DataConfig(data_path=((2.0, str(tmp_path / "a")), (1.0, str(tmp_path / "b")), (1.0, str(tmp_path / "c"))),
                     split="90,10,0")
    train, valid, test = build_train_valid_test_datasets(cfg, None, 16, (2000, 100, 0), seed=4)
    assert isinstance(train, BlendableDataset) and isinstance(valid, BlendableDataset) and test is None
    assert len(train) == sum(samples_per_dataset([2, 1, 1], 2000)) >= 2000 * 1.005
    fractions = np.bincount(train.dataset_index[:2000], minlength=3) / 2000
    assert np.all(np.abs(fractions - [0.5, 0.25, 0.25]) <= 0.01 * np.array([0.5, 0.25, 0.25]))
    # items really come from the component the blend index names
    for i in range(0, 2000, 97):
        component = train.datasets[train.dataset_index[i]]
        assert isinstance(component, GPTDataset)
        np.testing.assert_array_equal(train[i]["text"], component[int(train.dataset_sample_index[i])]["text"])
        assert train[i]["text"].shape == (17,)
    again = build_train_valid_test_datasets(cfg, None, 16, (2000, 100, 0), seed=4)[0]
    assert not again.built_indices
    np.testing.assert_array_equal(again.dataset_index, train.dataset_index)


def test_separate_train_valid_test_paths(tmp_path):
    make_dataset(tmp_path / "a", [30] * 50)
    make_dataset(tmp_path / "b", [30] * 50, seed=5)
    args = add_data_args(argparse.ArgumentParser()).parse_args(
        ["--train-data-path", "0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "b"),
         "--valid-data-path", str(tmp_path / "b")])
    cfg = data_config_from_args(args)
    train, valid, test = build_train_valid_test_datasets(cfg, None, 8, (100, 20, 5), seed=1)
    assert isinstance(train, BlendableDataset) and isinstance(valid, GPTDataset) and test is None
    assert valid.doc_idx.min() == 0 and valid.doc_idx.max() == 49  # the whole dataset, no split
    with pytest.raises(ValueError, match="--valid-data-path: .*missing.bin"):
        data_config_from_args(add_data_args(argparse.ArgumentParser()).parse_args(
            ["--train-data-path", str(tmp_path / "a"), "--valid-data-path", str(tmp_path / "missing")]))
    with pytest.raises(ValueError, match="--mock-data"):
        data_config_from_args(add_data_args(argparse.ArgumentParser()).parse_args([]))
