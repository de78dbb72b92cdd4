"""Requests in flight, and waiting for them to end when a server shuts down.

Every serving role drains the same way: count what it admitted, and on stop give the requests
still running up to a grace period before closing. ``InFlight`` is that count with an event set
whenever it is zero, so a drain waits on the event instead of polling the count.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class InFlight:
    """The number of requests being served; ``wait_idle``/``drain`` wait until it is zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self, n: int = 1) -> None:
        self.count += n
        self._idle.clear()

    def leave(self, n: int = 1) -> None:
        self.count -= n
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is left; False if ``timeout_s`` passed first."""
        if self.count == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def drain(self, grace_s: float, who: str) -> None:
        """Waits up to ``grace_s`` for the requests in flight (logged as ``who``'s drain)."""
        if not self.count:
            return
        logger.info("%s draining inflight=%d grace_s=%.1f", who, self.count, grace_s)
        if not await self.wait_idle(grace_s):
            logger.warning("%s stopping with requests in flight count=%d", who, self.count)
