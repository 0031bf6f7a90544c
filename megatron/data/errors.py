"""Errors of the data pipeline that the trainer reports as one line (megatron/training/errors.py)."""


class DataError(ValueError):
    """Training data that cannot be used; the message names the dataset prefix (or file) and the fix."""


class OtherRankDataError(RuntimeError):
    """This rank stops because another rank's data step failed; that rank reports the cause."""
