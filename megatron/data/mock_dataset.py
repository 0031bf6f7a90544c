"""``--mock-data``: deterministic synthetic GPT samples with structure a model can learn; never touches disk.

Tokens follow a small seeded Markov chain: 64 "active" token ids (or fewer for tiny vocabularies), each
with 4 equally likely successors, so a model's loss falls from ln(vocab) towards ln(4). Documents end
with eod (when the vocabulary holds it) and the chain restarts. Sample i of a split depends only on
(seed, split, i), never on how many processes read it.
"""
from __future__ import annotations

import numpy as np
import torch

SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}
ACTIVE_TOKENS = 64
SUCCESSORS = 4
MEAN_DOCUMENT_LENGTH = 128


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, split: str, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 eod: int | None = None):
        if split not in SPLIT_IDS:
            raise ValueError(f"split must be one of {', '.join(SPLIT_IDS)}, got {split!r}")
        self.eod = eod if eod is not None and 0 <= eod < vocab_size else None
        choices = [t for t in range(min(vocab_size, 4096)) if t != self.eod]
        if not choices or seq_length <= 0 or num_samples < 0:
            raise ValueError(f"mock data needs vocab_size >= 2 (got {vocab_size}), seq_length > 0 "
                             f"(got {seq_length}) and num_samples >= 0 (got {num_samples})")
        self.split, self.num_samples, self.seq_length, self.seed = split, num_samples, seq_length, seed
        # the chain is shared by all splits (only the seed picks it), so validation measures the same task
        rng = np.random.default_rng([seed, 0x6D6F636B])
        self.active = rng.choice(np.array(choices), size=min(ACTIVE_TOKENS, len(choices)), replace=False)
        self.successors = rng.integers(0, len(self.active), size=(len(self.active), SUCCESSORS)).tolist()
        self.description = (f"mock GPT data: split {split}, {num_samples} samples, seq {seq_length}, "
                            f"vocab {vocab_size}, seed {seed}, eod {self.eod}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for the mock {self.split} dataset of "
                             f"{self.num_samples} samples")
        rng = np.random.default_rng([self.seed, SPLIT_IDS[self.split], int(idx)])
        length = self.seq_length + 1
        branch = rng.integers(0, SUCCESSORS, size=length).tolist()
        restart = rng.integers(0, len(self.active), size=length).tolist()
        ends = (rng.random(length) < 1.0 / MEAN_DOCUMENT_LENGTH) if self.eod is not None else np.zeros(length, bool)
        successors = self.successors
        states = [0] * length
        state = restart[0]
        for t, end in enumerate(ends.tolist()):
            states[t] = state
            state = restart[t] if end else successors[state][branch[t]]
        tokens = self.active[states].astype(np.int64)
        if self.eod is not None:
            tokens[ends] = self.eod
        return {"text": tokens}
