"""Checkpoints of zero_cache states.

``distributed``: the distributed checkpoint (global tensors through torch.distributed.checkpoint; any mesh and
placement loads any checkpoint), its DCP planners, writer and reader in ``dcp_plumbing`` (imported on first
use), the chunks they exchange in ``global_tensor``. ``sharded``: DeepSpeed's per-rank layout (same layout
only), its directory names in ``names`` and ``consolidate`` its offline merge. ``interface``: what both need
from the owner of the states. ``errors``: the ``CheckpointError`` every module raises.
"""
from .errors import CheckpointError

__all__ = ["CheckpointError"]
