"""Checkpoints of zero_cache states.

``distributed``: the distributed checkpoint (global tensors through torch.distributed.checkpoint; any mesh and
placement loads any checkpoint), its DCP planners, writer and reader in ``dcp_plumbing`` (imported on first
use). ``sharded``: DeepSpeed's per-rank layout (same layout only) and ``consolidate``
its offline merge. ``interface``: what both need from the owner of the states.
"""
from .slices import CheckpointError

__all__ = ["CheckpointError"]
