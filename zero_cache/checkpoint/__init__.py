"""Sharded ZeRO checkpoints (every rank saves its own shards, in bounded slices) and offline consolidation."""
from .sharded import latest_tag, load, save
from .slices import CheckpointError

__all__ = ["save", "load", "latest_tag", "CheckpointError"]
