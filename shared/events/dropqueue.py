"""A bounded asyncio queue that drops its *oldest* item when full, and counts what it dropped.

Event consumers (the KV router, the console) care about the newest state: when a consumer falls
behind, a stale event is worth less than a fresh one, and blocking the producer (a socket reader or a
NATS callback) would stall every other subscription sharing that loop. ``asyncio.Queue`` can only
refuse the newest item, so the event plane uses this instead. The ``dropped`` counter is what a
caller exports as a metric and what tests assert on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """Raised by ``get`` once the queue is closed and empty."""


class DropOldestQueue(Generic[T]):
    """Single-loop, many-producer/one-consumer queue with a fixed capacity and drop-oldest policy."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"queue size must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._readable = asyncio.Event()
        self._closed = False
        self.dropped = 0  # items evicted because the consumer was slower than the producers
        self.put_count = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def free(self) -> int:
        return self.maxsize - len(self._items)

    def put_nowait(self, item: T) -> bool:
        """Appends ``item``; evicts the oldest item when full. Returns False if one was evicted."""
        if self._closed:
            return True
        evicted = False
        if len(self._items) >= self.maxsize:
            self._items.popleft()
            self.dropped += 1
            evicted = True
        self._items.append(item)
        self.put_count += 1
        self._readable.set()
        return not evicted

    def push_front(self, item: T) -> None:
        """Puts an item back at the head (a sender that could not deliver it). Never evicts it."""
        if self._closed:
            return
        if len(self._items) >= self.maxsize:
            self._items.pop()  # the newest loses, so the order of what survives stays intact
            self.dropped += 1
        self._items.appendleft(item)
        self._readable.set()

    def get_nowait(self) -> T | None:
        if not self._items:
            return None
        item = self._items.popleft()
        if not self._items:
            self._readable.clear()
        return item

    async def get(self) -> T:
        """Waits for the next item; raises QueueClosed once closed (pending items are discarded)."""
        while True:
            if self._closed:
                raise QueueClosed
            item = self.get_nowait()
            if item is not None:
                return item
            await self._readable.wait()

    async def wait_readable(self) -> None:
        """Waits until there is an item (or the queue is closed) without taking it."""
        while not self._items and not self._closed:
            await self._readable.wait()

    def close(self) -> None:
        """Wakes the consumer; further puts are ignored and ``get`` raises QueueClosed."""
        self._closed = True
        self._items.clear()
        self._readable.set()
