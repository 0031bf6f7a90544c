"""Data parallelism (Megatron-LM's ``megatron.core.distributed``)."""
from megatron.core.distributed.data_parallel import DistributedDataParallel, GradBucket

__all__ = ["DistributedDataParallel", "GradBucket"]
