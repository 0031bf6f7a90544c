"""After the parameter shards changed (an update, a lock-free publish, a checkpoint load), the gathered copies
follow: gathered copies of partitioned chunks are stale and dropped (the arena caches them), and every rank
updated its slice of the resident chunks, which are all-gathered back into their full buffers."""
from __future__ import annotations

from .chunk import FlatChunk
from .coordinator import ParamCoordinator
from .optimizer import ShardedAdam


class ParamRefresh:
    def __init__(self, chunks: list[FlatChunk], optimizer: ShardedAdam, coordinator: ParamCoordinator | None):
        self.resident = [c for c in chunks if c.plan.resident]
        self.optimizer = optimizer
        self.coordinator = coordinator

    def refresh(self) -> None:
        self.optimizer.wait_write_back()  # the compute stream waits for the parameters copied to the device
        if self.coordinator is not None:
            self.coordinator.drop_gathered()
        handles = [c.comm.all_gather(c.full, c.shard_of_full(), tag=f"chunk{c.index}", async_op=True)
                   for c in self.resident]
        for h in handles:
            h.wait()
