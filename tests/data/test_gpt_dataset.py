"""GPT dataset indices against Megatron's reference loops; epochs, shuffling, caching, rank-0 building."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from megatron.data import DataConfig, build_train_valid_test_datasets
from megatron.data.errors import DataError
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.index_builders import (
    build_doc_idx,
    build_gpt_indices,
    build_sample_idx,
    num_epochs_needed,
    split_boundaries,
)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from tests.data.common import make_dataset
from tests.dist_utils import run_distributed


def reference_num_epochs(tokens_per_epoch, seq_length, num_samples):
    epochs, total = 0, 0
    while True:  # Megatron's _num_epochs
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return epochs


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's _build_sample_idx (the Python twin of its C++ helper), line by line."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros([num_samples + 1, 2], dtype=np.int32)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return sample_idx


def reference_doc_idx(documents, num_epochs, rng):
    doc_idx = np.mgrid[0:num_epochs, 0:len(documents)][1]  # Megatron's construction
    doc_idx[:] = documents
    doc_idx = doc_idx.reshape(-1).astype(np.int32)
    rng.shuffle(doc_idx)
    return doc_idx


def reference_index_mappings(documents, sizes, num_samples, seq_length, seed):
    """Megatron's _build_index_mappings: epochs, separate last epoch, RNG order, shuffle dtype."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs = reference_num_epochs(tokens_per_epoch, seq_length, num_samples)
    np_rng = np.random.RandomState(seed=seed)
    separate_last_epoch = False
    if num_epochs > 1:
        from_epochs_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_num_samples = num_samples - from_epochs_minus_one
        separate_last_epoch = last_epoch_num_samples < int(0.80 * ((tokens_per_epoch - 1) // seq_length))
    if separate_last_epoch:
        doc_idx = np.concatenate((reference_doc_idx(documents, num_epochs - 1, np_rng),
                                  reference_doc_idx(documents, 1, np_rng)))
    else:
        doc_idx = reference_doc_idx(documents, num_epochs, np_rng)
    sample_idx = reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    first = from_epochs_minus_one if separate_last_epoch else total
    shuffle_first = np.arange(0, first, dtype=np.uint32)
    np_rng.shuffle(shuffle_first)
    shuffle_last = np.arange(first, total, dtype=np.uint32)
    np_rng.shuffle(shuffle_last)
    return doc_idx, sample_idx, np.concatenate((shuffle_first, shuffle_last)), separate_last_epoch


@pytest.mark.parametrize("num_samples", [10, 62, 62 + 5, 62 * 3 + 40, 400])
def test_index_mappings_equal_megatron(num_samples):
    rng = np.random.default_rng(num_samples)
    sizes = rng.integers(0, 100, size=20).astype(np.int32)
    documents = np.arange(3, 17, dtype=np.int32)
    ours = build_gpt_indices(documents, sizes, num_samples, 16, seed=11)
    doc_idx, sample_idx, shuffle_idx, _ = reference_index_mappings(documents, sizes, num_samples, 16, 11)
    np.testing.assert_array_equal(ours["doc_idx"], doc_idx)
    np.testing.assert_array_equal(ours["sample_idx"], sample_idx)
    np.testing.assert_array_equal(ours["shuffle_idx"], shuffle_idx)
    assert ours["shuffle_idx"].dtype == np.uint32 and ours["doc_idx"].dtype == np.int32


@pytest.mark.parametrize("seed", range(6))
def test_sample_idx_equals_megatron_loop(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, size=rng.integers(1, 60)).astype(np.int32)  # includes empty documents
    sizes[rng.integers(0, len(sizes))] = 5
    seq_length = int(rng.integers(1, 30))
    documents = np.arange(len(sizes), dtype=np.int32)
    tokens = int(sizes.sum())
    num_samples = int(rng.integers(0, 3 * tokens // seq_length + 2))
    epochs = num_epochs_needed(tokens, seq_length, num_samples)
    assert epochs == reference_num_epochs(tokens, seq_length, num_samples)
    doc_idx = build_doc_idx(documents, epochs, np.random.RandomState(seed), separate_last=False)
    np.testing.assert_array_equal(doc_idx, reference_doc_idx(documents, epochs, np.random.RandomState(seed)))
    ours = build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
    np.testing.assert_array_equal(ours, reference_sample_idx(sizes, doc_idx, seq_length, epochs, tokens))


def test_split_boundaries_match_megatron():
    assert split_boundaries("969,30,1", 1000) == [0, 969, 999, 1000]
    assert split_boundaries("98,2,0", 10) == [0, 10, 10, 10]  # 9.8 rounds to 10, the rest shifts
    assert split_boundaries("1", 7) == [0, 7, 7, 7]
    assert split_boundaries("80/10/10", 3) == [0, 3, 3, 3]  # rounding leaves 1 short; all shift up
    with pytest.raises(ValueError, match="--split"):
        split_boundaries("a,b", 10)


def gpt(prefix, num_samples, seq_length, seed, cache=None, documents=None):
    indexed = MMapIndexedDataset(prefix)
    documents = documents or range(0, len(indexed))
    return GPTDataset("train", str(prefix), indexed, documents, num_samples, seq_length, seed, cache, 1.0)


def stitched(ds):
    """Unshuffled samples joined, dropping the token each sample shares with the next."""
    return np.concatenate([ds.sample(i)[:-1] for i in range(len(ds))] + [ds.sample(len(ds) - 1)[-1:]])


def test_every_token_once_per_epoch_in_sample_order(tmp_path):
    sequences = make_dataset(tmp_path / "d", [7, 0, 13, 3, 25, 1, 9, 0, 40, 2] * 5)
    tokens_per_epoch = sum(len(s) for s in sequences)
    seq_length = 16
    # one epoch: the samples, in order, cover every token of the split exactly once
    one = gpt(tmp_path / "d", num_samples=(tokens_per_epoch - 1) // seq_length, seq_length=seq_length, seed=5)
    assert sorted(one.doc_idx.tolist()) == list(range(len(sequences)))
    stream = stitched(one)
    np.testing.assert_array_equal(stream, np.concatenate([sequences[d] for d in one.doc_idx])[:len(stream)])
    assert tokens_per_epoch - len(stream) < seq_length  # only a tail too short for a sample is left
    # three epochs (shuffled together, as Megatron does): every document three times, stream in doc_idx order
    ds = gpt(tmp_path / "d", num_samples=3 * tokens_per_epoch // seq_length, seq_length=seq_length, seed=5)
    assert sorted(ds.doc_idx.tolist()) == sorted(list(range(len(sequences))) * 3)
    stream = stitched(ds)
    expected = np.concatenate([sequences[d] for d in ds.doc_idx])
    assert all(len(ds.sample(i)) == seq_length + 1 for i in range(len(ds)))
    np.testing.assert_array_equal(stream, expected[:len(stream)])
    assert len(expected) - len(stream) < seq_length
    # shuffled items are a permutation of the samples
    assert sorted(tuple(ds[i]["text"].tolist()) for i in range(len(ds))) == \
        sorted(tuple(ds.sample(i).tolist()) for i in range(len(ds)))
    assert ds[0]["text"].dtype == np.int64


def test_shuffles_are_seeded_and_stable(tmp_path):
    make_dataset(tmp_path / "d", [30] * 40)
    a = build_gpt_indices(np.arange(40, dtype=np.int32), np.full(40, 30, np.int32), 100, 16, seed=7)
    b = build_gpt_indices(np.arange(40, dtype=np.int32), np.full(40, 30, np.int32), 100, 16, seed=7)
    c = build_gpt_indices(np.arange(40, dtype=np.int32), np.full(40, 30, np.int32), 100, 16, seed=8)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["doc_idx"], c["doc_idx"]) and not np.array_equal(a["shuffle_idx"], c["shuffle_idx"])
    # pinned values: the same seed gives the same order on any machine and numpy version
    assert a["shuffle_idx"][:8].tolist() == PINNED_SHUFFLE and a["doc_idx"][:8].tolist() == PINNED_DOC_IDX


PINNED_SHUFFLE = [42, 24, 73, 32, 45, 70, 37, 66]
PINNED_DOC_IDX = [17, 37, 34, 18, 32, 1, 22, 2]


def test_separate_last_epoch_shuffle(tmp_path):
    sizes = np.full(20, 50, np.int32)  # 1000 tokens, 62 samples of 16 per epoch
    idx = build_gpt_indices(np.arange(20, dtype=np.int32), sizes, 62 + 5, 16, seed=1)  # last epoch barely used
    first_epoch_samples = (1000 - 1) // 16
    assert sorted(idx["doc_idx"][:20].tolist()) == list(range(20))
    assert sorted(idx["doc_idx"][20:].tolist()) == list(range(20))
    assert set(idx["shuffle_idx"][:first_epoch_samples].tolist()) == set(range(first_epoch_samples))


def test_cached_indices_reused_and_invalidated(tmp_path):
    make_dataset(tmp_path / "d", [11, 23, 5, 40] * 10)
    first = gpt(tmp_path / "d", 50, 8, seed=3)
    assert first.built_indices
    cache = tmp_path / "index-cache"
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and sum(f.endswith(".npy") for f in files) == 3
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}
    again = gpt(tmp_path / "d", 50, 8, seed=3)
    assert not again.built_indices and {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes
    assert isinstance(again.shuffle_idx, np.memmap)
    assert [again[i]["text"].tolist() for i in range(len(again))] == \
        [first[i]["text"].tolist() for i in range(len(first))]
    for changed in (dict(num_samples=51), dict(seq_length=9), dict(seed=4), dict(documents=range(0, 30))):
        args = dict(num_samples=50, seq_length=8, seed=3) | changed
        assert gpt(tmp_path / "d", **args).built_indices, changed
    assert len(os.listdir(cache)) == 4 * 5
    # rewritten data with the same shape of config gets new indices too
    make_dataset(tmp_path / "d", [12, 23, 5, 40] * 10)
    assert gpt(tmp_path / "d", 50, 8, seed=3).built_indices


def test_data_cache_path_and_splits(tmp_path):
    make_dataset(tmp_path / "d", [20] * 100)
    cfg = DataConfig(data_path=((1.0, str(tmp_path / "d")),), split="80,15,5", data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, None, 32, (40, 8, 2), seed=1)
    assert (len(train.indexed.sizes), train.doc_idx.max(), valid.doc_idx.min(), valid.doc_idx.max(),
            test.doc_idx.min()) == (100, 79, 80, 94, 95)
    assert len(train) >= 40 and len(valid) >= 8 and len(test) >= 2
    assert len(os.listdir(tmp_path / "c")) == 12 and not os.path.exists(tmp_path / "index-cache")
    cfg0 = DataConfig(data_path=((1.0, str(tmp_path / "d")),), split="100,0,0")
    assert build_train_valid_test_datasets(cfg0, None, 32, (40, 8, 2), seed=1)[1:] == (None, None)


def _build_on_ranks(rank, world_size, prefix, cache, bad_cache):
    ds = gpt(prefix, 60, 8, seed=2, cache=cache)
    shared = (ds.built_indices, ds.shuffle_idx.tolist(), ds.sample_idx.tolist(), ds.doc_idx.tolist())
    try:  # a build that fails on rank 0 (its cache path is a file) must fail every rank, not hang them
        gpt(prefix, 61, 8, seed=2, cache=bad_cache)
    except Exception as e:  # noqa: BLE001 - the test inspects which error each rank sees
        return shared, (type(e).__name__, str(e))
    return shared, None


@pytest.mark.multiprocess
def test_indices_built_on_rank0_and_shared(tmp_path):
    make_dataset(tmp_path / "d", [9, 31, 4, 17] * 8)
    cache, not_a_dir = str(tmp_path / "shared-cache"), tmp_path / "cache-is-a-file"
    not_a_dir.write_text("x")
    (shared0, error0), (shared1, error1) = run_distributed(_build_on_ranks, 2, str(tmp_path / "d"), cache,
                                                           str(not_a_dir))
    assert (shared0[0], shared1[0]) == (True, False)  # built on rank 0 only
    assert shared0[1:] == shared1[1:]
    local = gpt(tmp_path / "d", 60, 8, seed=2, cache=cache)
    assert not local.built_indices and local.shuffle_idx.tolist() == shared0[1]
    assert error0[0] in ("FileExistsError", "NotADirectoryError")
    assert error1[0] == "OtherRankDataError" and "rank 0 failed" in error1[1]  # errors.py: not this rank's cause


def test_empty_split_is_a_clear_error(tmp_path):
    builder = MMapIndexedDatasetBuilder(f"{tmp_path / 'd'}.bin", np.uint16)
    builder.add_document([], [0, 0])  # zero-length sequences, as other tools may write
    builder.add_document([1, 2, 3], [3])
    builder.finalize(f"{tmp_path / 'd'}.idx")
    with pytest.raises(ValueError, match="has no tokens"):
        gpt(tmp_path / "d", 10, 4, seed=0, documents=range(0, 2))
    assert len(gpt(tmp_path / "d", 2, 1, seed=0)) == 2



def test_unusable_datasets_are_refused_at_build_time_naming_prefix_and_fix(tmp_path):
    """Without these checks the trainer gets no train dataset and fails later with a TypeError."""
    empty = tmp_path / "empty"
    make_dataset(empty, [])  # what tools/preprocess_data.py used to write for an empty JSONL
    tiny = tmp_path / "tiny"
    make_dataset(tiny, [5, 6])  # 11 tokens: less than one sample of 17
    few = tmp_path / "few"
    make_dataset(few, [40, 40])

    def build(prefix, split="969,30,1", seq_length=16):
        cfg = DataConfig(data_path=((1.0, str(prefix)),), split=split)
        return build_train_valid_test_datasets(cfg, None, seq_length, (8, 0, 0), seed=1)

    with pytest.raises(DataError, match=rf"^{empty}.bin/.idx holds no documents .*preprocess a non-empty corpus"):
        build(empty)
    with pytest.raises(DataError, match=rf"^{tiny}.bin/.idx holds 11 tokens, fewer than one sample of 17 "
                                        r"\(--seq-length 16 \+ 1\); give it more data or use a smaller --seq-length"):
        build(tiny)
    assert len(build(tiny, seq_length=8)[0]) >= 8
    with pytest.raises(DataError, match=rf"the train split of {few} has no documents \(2 in all, --split 0,1,0\); "
                                        r"give the train split a larger share"):
        build(few, split="0,1,0")
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(DataError, match="bad magic"):  # an unreadable file is a data error too, not a traceback
        build(tmp_path / "bad")


def test_datasets_pickle_as_paths(tmp_path):
    """Spawned data-loader workers receive file names, not copies of the mapped data."""
    make_dataset(tmp_path / "d", [50] * 400)
    ds = gpt(tmp_path / "d", 1000, 16, seed=1)
    blob = pickle.dumps(ds)
    assert len(blob) < 4096 < ds.indexed._bin.nbytes
    copy = pickle.loads(blob)
    assert isinstance(copy.shuffle_idx, np.memmap) and isinstance(copy.indexed._bin, np.memmap)
    assert all(np.array_equal(copy[i]["text"], ds[i]["text"]) for i in (0, 500, 999))
