"""The bounded queue where requests wait while every candidate worker is busy.

Order: by priority, FIFO within a priority, with aging so that no priority starves. Priorities are
Dynamo's (``nvext.agent_hints.priority``: higher is more urgent, 0 or absent is the default). As in
Dynamo's router queue, a priority moves a request's place in line by time, not by class: a request
of priority ``p`` that arrives at ``t`` is ordered as if it had arrived at
``t - p * priority_jump_s`` (the "jump"; ``priority_jump_s`` defaults to one second per priority
point). Within one priority that is plain FIFO. Across priorities it is aging: a request of priority
``p`` is passed only by requests of priority ``q > p`` arriving less than ``(q - p) *
priority_jump_s`` after it, so once it has waited that long nothing new can go ahead of it, however
many urgent requests keep arriving. A jump is clamped to the queue timeout either way: every request
still in line arrived less than one timeout ago, so a larger jump would not reorder anything, and
the clamp keeps an absurd priority (2^31) from meaning "forever first".

Only the head retries, whenever the router's state changes in a way that can free capacity
(``notify``: a request freed or prefilled, new load metrics, a worker added), and at least every
``recheck_s`` (load metrics age out and stale requests expire without a notification). A request
that joins ahead of the current head becomes the head and tries at once. A head that gets its
worker wakes the next one. Full queue or waited too long: ``OverloadedError`` (HTTP 503), so
clients back off instead of piling up.

``on_wait(priority, seconds)`` is told every request's time in line (0 when it did not wait), for
the queue-wait metric by priority class.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
from collections.abc import Callable
from typing import TypeVar

from dynamod.shared.errors import OverloadedError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PRIORITY_JUMP_S = 1.0  # Dynamo: one priority point moves a request one second ahead


class _Waiter:
    __slots__ = ("key", "priority", "wake")

    def __init__(self, key: tuple[float, int], priority: int) -> None:
        self.key = key  # (effective arrival time, arrival number): smaller is served first
        self.priority = priority
        self.wake: asyncio.Future[None] | None = None


def _key(waiter: _Waiter) -> tuple[float, int]:
    return waiter.key


class WaitQueue:
    def __init__(
        self,
        max_size: int,
        timeout_s: float,
        *,
        recheck_s: float = 0.25,
        priority_jump_s: float = DEFAULT_PRIORITY_JUMP_S,
        on_wait: Callable[[int, float], None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: arrival times for the queue order (default the event loop's; a router
        driven by a simulated clock passes its own). Deadlines always run on the loop's time."""
        if not (math.isfinite(priority_jump_s) and priority_jump_s >= 0):
            raise ValueError(f"priority_jump_s must be a finite number >= 0, got {priority_jump_s}")
        self.max_size = max_size
        self.timeout_s = timeout_s
        self.recheck_s = recheck_s
        self.priority_jump_s = priority_jump_s
        self.on_wait = on_wait
        self._clock = clock
        self._waiters: list[_Waiter] = []  # sorted by key; [0] is the head
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def jump_s(self, priority: int) -> float:
        """How far ahead (seconds; negative: behind) ``priority`` moves a request, clamped to the
        queue timeout (see the module docstring)."""
        jump = priority * self.priority_jump_s
        cap = self.timeout_s
        return max(-cap, min(cap, jump))

    def queued_priorities(self) -> list[int]:
        """The waiting requests' priorities, head first (for tests and diagnostics)."""
        return [w.priority for w in self._waiters]

    def notify(self) -> None:
        """Capacity may have been freed: let the head retry. Safe to call from sync code."""
        if self._waiters:
            wake = self._waiters[0].wake
            if wake is not None and not wake.done():
                wake.set_result(None)

    async def run(
        self, attempt: Callable[[], T | None], *, timeout_s: float | None = None, priority: int = 0
    ) -> T:
        """Returns ``attempt()``'s first non-None result, waiting in line while it returns None.

        A request goes straight to ``attempt`` only when nobody is waiting: with a queue, even an
        urgent request takes its place in line (which may be the head)."""
        if not self._waiters:
            result = attempt()
            if result is not None:
                self._observe(priority, 0.0)
                return result
        if len(self._waiters) >= self.max_size:
            raise OverloadedError(f"all workers busy and the router queue is full ({self.max_size} waiting)")
        loop = asyncio.get_running_loop()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        start = loop.time()
        deadline = start + timeout
        arrived = start if self._clock is None else self._clock()
        waiter = _Waiter((arrived - self.jump_s(priority), next(self._arrivals)), priority)
        bisect.insort(self._waiters, waiter, key=_key)
        try:
            while True:
                if self._waiters[0] is waiter:
                    result = attempt()
                    if result is not None:
                        self._observe(priority, loop.time() - start)
                        return result
                remaining = deadline - loop.time()
                if remaining <= 0:
                    logger.info(
                        "router queue timeout waited_s=%.3f priority=%d queued=%d", timeout, priority, len(self._waiters)
                    )
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

    def _observe(self, priority: int, waited_s: float) -> None:
        if self.on_wait is not None:
            self.on_wait(priority, waited_s)
