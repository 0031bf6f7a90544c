"""Errors of the data pipeline that the trainer reports as one line (megatron/training/errors.py)."""


class DataError(ValueError):
    """Training data that cannot be used; the message names the dataset prefix (or file) and the fix."""


class OtherRankDataError(RuntimeError):
    """This rank stops because another rank's data step failed; that rank reports the cause."""


def check_token_ids(text, vocab_size: int, source: str) -> None:
    """Refuse a batch (a torch tensor of token ids) holding an id outside the tokenizer's vocabulary: data
    preprocessed with another tokenizer would index the embedding out of range, or train its padding rows."""
    low, high = int(text.min()), int(text.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise DataError(f"token id {bad} in the training data ({source}) is outside this run's vocabulary of "
                        f"{vocab_size}; preprocess the data with the tokenizer this run uses, or give that "
                        f"tokenizer's flags (--tokenizer-type, --vocab-file / --vocab-size)")
