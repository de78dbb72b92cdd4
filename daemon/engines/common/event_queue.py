"""The bounded queue between an engine's KV events and the worker that publishes them.

Native adapters (``native_kv``) and the mocker hand their numbered ``RouterEvent``s over the same
way: a bounded queue that, when the worker falls behind, drops the new event rather than block
the engine (the ``event_id`` gap it leaves makes the router re-read the worker through
``kv_dump``, the designed recovery), logs once per burst of drops, and ends its one consumer with
an end marker that takes the oldest event's place when the buffer is full.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from dynamod.shared.protocol.kv_events import RouterEvent

logger = logging.getLogger(__name__)


class RouterEventQueue(asyncio.Queue[RouterEvent | None]):
    """``offer`` from the engine side, ``stream()`` for the one consumer, ``close()`` at the end."""

    def __init__(self, worker_id: int, maxsize: int) -> None:
        super().__init__(maxsize=maxsize)
        self.worker_id = worker_id
        self.dropped = 0
        self.closed = False
        self._dropping = False  # in a burst of drops (logged once per burst)

    def offer(self, ev: RouterEvent) -> None:
        """Queues ``ev``; drops it when the buffer is full, and everything once closed."""
        if self.closed:
            return
        if self.full():
            if not self._dropping:
                self._dropping = True
                logger.warning(
                    "kv event buffer full worker_id=%016x event_id=%d dropped_total=%d",
                    self.worker_id, ev.event_id, self.dropped + 1,
                )
            self.dropped += 1
            return
        self._dropping = False
        self.put_nowait(ev)

    async def stream(self) -> AsyncIterator[RouterEvent]:
        """The events in order; ends after ``close()``."""
        while True:
            ev = await self.get()
            if ev is None:
                return
            yield ev

    def close(self) -> None:
        """Ends ``stream()``: the end marker replaces the oldest event if the buffer is full."""
        if self.closed:
            return
        self.closed = True
        if self.full():
            self.get_nowait()
            self.dropped += 1
        self.put_nowait(None)
