"""The model states of one chunk's shard, named by an enum (strings exist only at the checkpoint boundary)."""
from __future__ import annotations

from enum import Enum


class State(str, Enum):
    """One stored tensor of a chunk's shard. Its value is the suffix of the store key (``c<i>.<value>``) and the
    checkpoint's state name where it has one (``param``, ``exp_avg``, ``exp_avg_sq``)."""
    FULL = "full"  # a resident chunk's whole buffer (compute dtype, on the device); PARAM is its slice
    PARAM = "param"  # compute dtype, this rank's slice of the parameters
    MASTER = "master"  # fp32 optimizer copy (the parameter shard itself in fp32, see placement.py)
    GRAD = "grad"  # fp32 gradient shard, accumulated over micro-batches
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    GRAD_SPARE = "grad_spare"  # lock-free update: the gradients being applied in the background
    PENDING = "pending"  # lock-free update: updated parameters not yet published


ADAM_MOMENTS = (State.EXP_AVG, State.EXP_AVG_SQ)
