"""Errors of the data pipeline that the trainer reports as one line (megatron/training/errors.py)."""


class DataError(ValueError):
    """Training data that cannot be used; the message names the dataset prefix (or file) and the fix."""


class OtherRankDataError(RuntimeError):
    """This rank stops because another rank's data step failed; that rank reports the cause."""


def check_token_ids(text, vocab_size: int, data) -> None:
    """Refuse a batch (a torch tensor of token ids) holding an id outside the tokenizer's vocabulary: data
    preprocessed with another tokenizer would index the embedding out of range, or train its padding rows.
    ``data``: the run's ``DataConfig``, described in the message."""
    low, high = (int(v) for v in text.aminmax())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise DataError(f"token id {bad} in the training data ({data.describe()}) is outside this run's "
                        f"vocabulary of {vocab_size}; preprocess the data with the tokenizer this run uses, or give "
                        f"that tokenizer's flags (--tokenizer-type, --vocab-file / --vocab-size)")
