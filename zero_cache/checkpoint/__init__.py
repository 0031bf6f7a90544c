"""Sharded ZeRO checkpoints (every rank saves its own shards) and offline consolidation."""
from .sharded import latest_tag, load, save

__all__ = ["save", "load", "latest_tag"]
