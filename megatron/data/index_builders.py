"""The GPT dataset's index arrays, the blend index and the --split boundaries, as Megatron-LM defines them.

- ``doc_idx``: the split's documents tiled once per epoch and shuffled; when the last epoch is used less
  than 80%, it is shuffled separately so its unused tail does not crowd out earlier epochs.
- ``sample_idx`` [num_samples + 1, 2]: sample i covers tokens from (doc_idx position, offset) row i to row
  i + 1 inclusive, so samples have seq_length + 1 tokens and overlap the next one by one token.
- ``shuffle_idx``: a permutation of samples (the separate last epoch is permuted on its own).
RNG use matches Megatron (one ``np.random.RandomState(seed)`` drawn in the same order), so the arrays
are identical to Megatron's for the same documents, sizes, seed and sample count. Megatron builds
``sample_idx`` with a C++ loop; here it is vectorised over the cumulative token count.
"""
from __future__ import annotations

import numpy as np

LAST_EPOCH_SEPARATE_BELOW = 0.80


def split_boundaries(split: str, size: int) -> list[int]:
    """Megatron's ``get_train_valid_test_split_``: ``'969,30,1'`` -> 4 document boundaries over ``size``."""
    try:
        weights = [float(s) for s in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three numbers like 969,30,1") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(size))))
    diff = bounds[-1] - size
    return [bounds[0]] + [b - diff for b in bounds[1:]]


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E >= 1 with (E * tokens_per_epoch - 1) // seq_length >= num_samples."""
    if tokens_per_epoch <= 0:
        raise ValueError("cannot draw samples from a split with no tokens")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_last_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int) -> bool:
    if num_epochs == 1:
        return False
    samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    last_epoch_samples = num_samples - samples_before_last
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return last_epoch_samples < int(LAST_EPOCH_SEPARATE_BELOW * samples_per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last: bool) -> np.ndarray:
    if separate_last and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        last = build_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """Row i = (position in doc_idx, token offset) where sample i starts; row i + 1 is where it ends.

    Sample i starts at token i * seq_length of the doc_idx-ordered token stream. Megatron's loop steps
    through documents, which places a start on the document that holds that token (never on an empty
    one). Here each document counts the starts that fall inside it, and np.repeat lays them out.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = np.asarray(sizes, dtype=np.int64)[doc_idx]
    doc_ends = np.cumsum(doc_lengths)
    # starts k * seq_length (k = 1..num_samples) before each document's end
    starts_before_end = np.clip((doc_ends - 1) // seq_length, 0, num_samples)
    starts_inside = np.diff(starts_before_end, prepend=0)
    position = np.repeat(np.arange(len(doc_idx), dtype=np.int64), starts_inside)
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    offset = starts - np.repeat(doc_ends - doc_lengths, starts_inside)
    dtype = np.int32 if len(doc_idx) < np.iinfo(np.int32).max else np.int64
    sample_idx = np.zeros((num_samples + 1, 2), dtype=dtype)
    sample_idx[1:, 0] = position
    sample_idx[1:, 1] = offset
    return sample_idx


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) followed by a separate permutation of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(documents: np.ndarray, sizes: np.ndarray, num_samples: int, seq_length: int,
                      seed: int) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx for ``num_samples`` samples of ``documents``."""
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last = separate_last_epoch(num_epochs, tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate_last)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_last else total
    shuffle_idx = build_shuffle_idx(shuffled, total, rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def build_blending_indices(weights: np.ndarray, size: int) -> dict[str, np.ndarray]:
    """Megatron's greedy blend: sample i comes from the dataset furthest behind its share.

    The error of dataset d at step i is w_d * max(i, 1) - count_d; the largest wins (ties: lowest d).
    Each step depends on the previous counts, so this is a plain loop over Python floats (the same
    double arithmetic as Megatron's C++); a single dataset needs no loop.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) > 255:
        raise ValueError(f"at most 255 datasets can be blended, got {len(weights)}")
    if len(weights) == 1:
        return {"dataset_index": np.zeros(size, dtype=np.uint8),
                "dataset_sample_index": np.arange(size, dtype=np.int64)}
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    choice = bytearray(size)
    sample = [0] * size
    datasets = range(1, len(w))
    for i in range(size):
        step = float(max(i, 1))
        best, best_error = 0, w[0] * step - counts[0]
        for d in datasets:
            error = w[d] * step - counts[d]
            if error > best_error:
                best, best_error = d, error
        choice[i] = best
        sample[i] = counts[best]
        counts[best] += 1
    return {"dataset_index": np.frombuffer(bytes(choice), dtype=np.uint8).copy(),
            "dataset_sample_index": np.array(sample, dtype=np.int64)}
