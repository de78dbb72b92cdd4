"""The part of a subscriber that is the same on every event-plane transport (NATS, ZMQ).

A transport's receive callback puts each message into a bounded drop-oldest queue (dropqueue.py:
a slow consumer loses the oldest events and never stalls the socket or the NATS connection); the
consumer iterates the queue until the subscriber is closed. ``QueuedSubscriber`` holds that queue,
its counters and the iteration; a transport adds how messages arrive and how it closes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from dynamod.shared.events.dropqueue import DropOldestQueue, QueueClosed
from dynamod.shared.events.plane import EventMessage


class QueuedSubscriber:
    """Iterates the events of one scope's topic from a bounded drop-oldest queue."""

    def __init__(self, namespace: str, component: str, topic: str, *, queue_size: int) -> None:
        self.namespace = namespace
        self.component = component
        self.topic = topic
        self._queue: DropOldestQueue[EventMessage] = DropOldestQueue(queue_size)
        self._closed = False

    @property
    def dropped(self) -> int:
        """Events discarded (oldest first) because the consumer fell behind."""
        return self._queue.dropped

    @property
    def received(self) -> int:
        return self._queue.put_count

    def __aiter__(self) -> AsyncIterator[EventMessage]:
        return self

    async def __anext__(self) -> EventMessage:
        try:
            return await self._queue.get()
        except QueueClosed:
            raise StopAsyncIteration from None
