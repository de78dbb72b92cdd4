"""The bounded queue where requests wait while every candidate worker is busy.

FIFO: only the head retries, whenever the router's state changes in a way that can free capacity
(``notify``: a request freed or prefilled, new load metrics, a worker added), and at least every
``recheck_s`` (load metrics age out and stale requests expire without a notification). A head
that gets its worker wakes the next one. Full queue or waited too long: ``OverloadedError``
(HTTP 503), so clients back off instead of piling up.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from dynamod.shared.errors import OverloadedError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Waiter:
    __slots__ = ("wake",)

    def __init__(self) -> None:
        self.wake: asyncio.Future[None] | None = None


class WaitQueue:
    def __init__(self, max_size: int, timeout_s: float, *, recheck_s: float = 0.25) -> None:
        self.max_size = max_size
        self.timeout_s = timeout_s
        self.recheck_s = recheck_s
        self._waiters: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Capacity may have been freed: let the head retry. Safe to call from sync code."""
        if self._waiters:
            wake = self._waiters[0].wake
            if wake is not None and not wake.done():
                wake.set_result(None)

    async def run(self, attempt: Callable[[], T | None], *, timeout_s: float | None = None) -> T:
        """Returns ``attempt()``'s first non-None result, waiting in line while it returns None."""
        if not self._waiters:
            result = attempt()
            if result is not None:
                return result
        if len(self._waiters) >= self.max_size:
            raise OverloadedError(f"all workers busy and the router queue is full ({self.max_size} waiting)")
        loop = asyncio.get_running_loop()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + timeout
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            while True:
                if self._waiters[0] is waiter:
                    result = attempt()
                    if result is not None:
                        return result
                remaining = deadline - loop.time()
                if remaining <= 0:
                    logger.info("router queue timeout waited_s=%.3f queued=%d", timeout, len(self._waiters))
                    raise OverloadedError(f"all workers busy for {timeout:g} s", retry_after_s=1.0)
                waiter.wake = loop.create_future()
                try:
                    await asyncio.wait_for(waiter.wake, min(remaining, self.recheck_s))
                except TimeoutError:
                    pass
        finally:
            was_head = bool(self._waiters) and self._waiters[0] is waiter
            self._waiters.remove(waiter)
            if was_head:
                self.notify()
