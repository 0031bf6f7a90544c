"""Data loading: Megatron's sampler order and exact resume, masks/position ids, mock data."""
from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from megatron.data import (
    DataConfig,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
    build_train_valid_test_datasets,
    get_ltor_masks_and_position_ids,
)
from megatron.data.mock_dataset import MockGPTDataset
from megatron.tokenizer import NullTokenizer


def reference_sampler(total, consumed, mbs, dp_rank, dp_size):
    """Megatron's MegatronPretrainingSampler.__iter__ (drop_last=True), transcribed."""
    batch, out = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp_size:
            out.append(batch[dp_rank * mbs:(dp_rank + 1) * mbs])
            batch = []
    return out


@pytest.mark.parametrize("total, consumed, mbs, dp", [(100, 0, 4, 2), (103, 24, 3, 4), (50, 49, 1, 1), (64, 8, 8, 1)])
def test_sampler_matches_megatron(total, consumed, mbs, dp):
    for rank in range(dp):
        sampler = MegatronPretrainingSampler(total, consumed, mbs, rank, dp)
        batches = list(sampler)
        assert batches == reference_sampler(total, consumed, mbs, rank, dp)
        assert len(sampler) == len(batches)


def test_sampler_rejects_exhausted_dataset():
    with pytest.raises(ValueError, match="exhausted"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)


def test_loader_resumes_exactly_and_splits_across_ranks():
    dataset = MockGPTDataset("train", 96, 8, 300, seed=3)
    mbs, dp = 2, 3
    full = [[b["text"] for b in build_pretraining_data_loader(dataset, 0, mbs, r, dp, num_workers=0)]
            for r in range(dp)]
    # one global batch = the dp ranks' micro-batches of a slice of consecutive samples
    step = 5
    global_batch = torch.cat([full[r][step] for r in range(dp)])
    first, end = step * mbs * dp, (step + 1) * mbs * dp
    expected = torch.stack([torch.from_numpy(dataset[i]["text"]) for i in range(first, end)])
    assert torch.equal(global_batch, expected)
    # resuming from a checkpoint's consumed samples continues with exactly the next batches
    consumed = 7 * mbs * dp
    for r in range(dp):
        resumed = [b["text"] for b in build_pretraining_data_loader(dataset, consumed, mbs, r, dp, num_workers=0)]
        assert len(resumed) == len(full[r]) - 7
        assert all(torch.equal(a, b) for a, b in zip(resumed, full[r][7:]))
    first = full[0][0]
    assert first.dtype == torch.int64 and first.shape == (mbs, 9)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1, 0) is None


@pytest.mark.multiprocess
def test_worker_processes_do_not_change_batches():
    dataset = MockGPTDataset("valid", 24, 16, 5000, seed=9, eod=4999)
    plain = [b["text"] for b in build_pretraining_data_loader(dataset, 4, 4, 0, 1, num_workers=0)]
    workers = [b["text"] for b in build_pretraining_data_loader(dataset, 4, 4, 0, 1, num_workers=2)]
    assert len(plain) == 5 and all(torch.equal(a, b) for a, b in zip(plain, workers))


_SERVER_CHECK = """
import psutil
from megatron.data import build_pretraining_data_loader
from megatron.data.mock_dataset import MockGPTDataset

it = iter(build_pretraining_data_loader(MockGPTDataset("train", 24, 16, 300, seed=1), 0, 4, 0, 1, num_workers=2))
next(it)
(server,) = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
workers = server.children()
libtorch = [m.path for m in server.memory_maps() if "libtorch_cpu" in m.path]
print(len(workers), bool(libtorch))
"""


@pytest.mark.multiprocess
def test_workers_fork_from_a_server_that_imported_torch():
    """In a fresh process (no forkserver yet): the loader's workers are children of one forkserver that
    mapped libtorch before they forked, so no worker imports torch itself."""
    out = subprocess.run([sys.executable, "-c", _SERVER_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "True"]


def test_mock_data_is_deterministic_and_learnable():
    cfg = DataConfig(mock_data=True)
    train, valid, test = build_train_valid_test_datasets(cfg, NullTokenizer(999), 128, (400, 40, 0), seed=1)
    assert test is None and len(train) == 400 and len(valid) == 40
    again = MockGPTDataset("train", 400, 128, 1000, seed=1, eod=999)
    assert all(np.array_equal(train[i]["text"], again[i]["text"]) for i in (0, 17, 399))
    assert not np.array_equal(train[0]["text"], valid[0]["text"])
    assert not np.array_equal(train[0]["text"], MockGPTDataset("train", 400, 128, 1000, seed=2)[0]["text"])
    tokens = np.concatenate([train[i]["text"] for i in range(len(train))])
    assert tokens.min() >= 0 and tokens.max() <= 999 and tokens.shape == (400 * 129,)
    eod_fraction = np.mean(tokens == 999)
    assert 0.003 < eod_fraction < 0.02  # documents of ~128 tokens
    # next-token entropy given the current token is about ln 4; unconditional entropy about ln 64
    follows = defaultdict(Counter)
    for a, b in zip(tokens[:-1], tokens[1:]):
        if a != 999 and b != 999:
            follows[a][b] += 1
    total = sum(sum(c.values()) for c in follows.values())
    conditional = -sum(n / total * math.log(n / sum(c.values())) for c in follows.values() for n in c.values())
    counts = np.bincount(tokens[tokens != 999])
    p = counts[counts > 0] / counts.sum()
    assert conditional < 1.45 and -(p * np.log(p)).sum() > 3.8
    with pytest.raises(ValueError, match="vocabulary size"):
        build_train_valid_test_datasets(cfg, None, 128, (1, 0, 0), seed=1)


def reference_masks(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's get_ltor_masks_and_position_ids, transcribed (loops and all)."""
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(
        att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(data).clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token].clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= (i + 1 - prev_index)
                    prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("reset_position_ids, reset_attention_mask, eod_mask_loss",
                         [(False, False, False), (True, False, True), (False, True, False), (True, True, True)])
def test_masks_and_position_ids_match_megatron(reset_position_ids, reset_attention_mask, eod_mask_loss):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (3, 40), generator=gen)
    tokens[0, 0] = 5
    tokens[1, -1] = 5
    tokens[2] = torch.where(tokens[2] == 5, 4, tokens[2])  # a row without eod
    mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, 5, reset_position_ids,
                                                                    reset_attention_mask, eod_mask_loss)
    ref_mask, ref_loss, ref_pos = reference_masks(tokens, 5, reset_position_ids, reset_attention_mask, eod_mask_loss)
    assert torch.equal(loss_mask, ref_loss) and loss_mask.dtype == torch.float
    assert torch.equal(position_ids, ref_pos) and position_ids.dtype == torch.long
    if reset_attention_mask:
        assert torch.equal(mask, ref_mask) and mask.dtype == torch.bool
    else:
        assert mask is None  # plain causal attention
        assert torch.equal(ref_mask[0, 0], ~torch.ones(40, 40, dtype=torch.bool).tril())
