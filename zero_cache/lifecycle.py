"""The chunk lifecycle: what happens to a chunk in a step, as events that parts emit and other parts hear.

    gather ──▶ in use (forward) ──▶ released ──▶ gather (backward) ──▶ gradients arrive ──▶ grad_ready
      ▲                                                                                        │
      │                                                                             reduce-scatter into the shard
      │                                                                                        ▼
    written back ◀── updated (the update strategy) ◀── step ◀── grad_final ◀── [grad_sent ─▶ grad_changing]
                                                                                 (a shard on the host)

Emitters: the coordinator (gathers and releases, coordinator.py) and the gradient reducer (grad_reducer.py).
Listeners (``ChunkListener``) override the events they act on:

- ``backward_touched``: a backward pass reached a managed parameter (every hook calls it; the engine acts on
  the first one of each autograd pass);
- ``may_gather(c)`` / ``before_gather(c)``: chunk ``c``'s shard is about to be read for a gather. A prefetch
  asks ``may_gather`` and skips the chunk if any listener says no; a gather calls ``before_gather``, which may
  block (the overlapped update waits for the chunk's update; the speculative one revokes a speculation);
- ``grad_ready(c)``: every gradient of ``c`` in this pass is in its buffer (the coordinator releases ``c``);
- ``grad_sent(c)``: the step's final reduced gradient of ``c`` is on its way to the host (training thread);
- ``grad_changing(c)`` / ``grad_final(c)``: the host lane is about to accumulate into ``c``'s shard / has made
  it final for the step (the speculative update acts on both).

``ChunkEvents`` is the dispatcher: the engine owns it, the builder subscribes the listeners in order before
any event is emitted. Events come from the training thread, except ``grad_changing`` and ``grad_final``, which
come from the host lane.
"""
from __future__ import annotations


class ChunkListener:
    """A part that reacts to chunk events; every event is a no-op here."""

    def backward_touched(self) -> None:
        pass

    def may_gather(self, chunk: int) -> bool:
        return True

    def before_gather(self, chunk: int) -> None:
        pass

    def grad_ready(self, chunk: int) -> None:
        pass

    def grad_sent(self, chunk: int) -> None:
        pass

    def grad_changing(self, chunk: int) -> None:
        pass

    def grad_final(self, chunk: int) -> None:
        pass


class ChunkEvents(ChunkListener):
    """Delivers each event to the subscribed listeners, in subscription order."""

    def __init__(self) -> None:
        self._listeners: list[ChunkListener] = []

    def subscribe(self, listener: ChunkListener) -> None:
        self._listeners.append(listener)

    def backward_touched(self) -> None:
        for x in self._listeners:
            x.backward_touched()

    def may_gather(self, chunk: int) -> bool:
        return all(x.may_gather(chunk) for x in self._listeners)

    def before_gather(self, chunk: int) -> None:
        for x in self._listeners:
            x.before_gather(chunk)

    def grad_ready(self, chunk: int) -> None:
        for x in self._listeners:
            x.grad_ready(chunk)

    def grad_sent(self, chunk: int) -> None:
        for x in self._listeners:
            x.grad_sent(chunk)

    def grad_changing(self, chunk: int) -> None:
        for x in self._listeners:
            x.grad_changing(chunk)

    def grad_final(self, chunk: int) -> None:
        for x in self._listeners:
            x.grad_final(chunk)
