"""The one error of the checkpoint code: every module here raises it, and callers catch it as a user error."""


class CheckpointError(RuntimeError):
    """A missing, truncated or corrupted checkpoint file; the message names it."""
