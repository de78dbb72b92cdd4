"""One value that must reach discovery even if discovery is away right now.

An operator's action (drain, sleep, a loaded adapter) takes effect in the worker at once; its
discovery record must follow, and a discovery outage must delay it, not lose it or hold the
operator's command for as long as the outage lasts. ``RetryingWrite`` writes the newest value
submitted, retrying with capped backoff until a write succeeds; a newer value replaces one not
yet written (only the last wish counts); the submitter waits a short while and learns whether it
was written or is still pending.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from dynamod.shared.errors import DynamoError

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_MIN_S = 0.25
RETRY_MAX_S = 5.0
DEFAULT_WAIT_S = 1.0


class RetryingWrite(Generic[T]):
    def __init__(self, what: str, write: Callable[[T], Awaitable[None]], *,
                 retry_min_s: float = RETRY_MIN_S, retry_max_s: float = RETRY_MAX_S) -> None:
        self.what = what
        self._write = write
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._pending: T | None = None
        self._version = 0  # bumps per submit, so a late success of an older value is not taken for the newer
        self._written_version = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.last_error: BaseException | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    async def submit(self, value: T, *, wait_s: float = DEFAULT_WAIT_S) -> bool:
        """Writes ``value`` (in the background, retried until it lands); True if it was written
        within ``wait_s``, False if it is still pending."""
        self._version += 1
        version = self._version
        self._pending = value
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"retrying-write:{self.what}")
        deadline = asyncio.get_running_loop().time() + wait_s
        while self._written_version < version:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                logger.warning("discovery write pending what=%s error=%s; retrying until it lands", self.what, self.last_error)
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                continue
        return True

    async def close(self) -> None:
        """Stops retrying and drops the pending value (shutdown, or a newer write superseded it)."""
        task, self._task = self._task, None
        self._pending = None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        delay = self._retry_min_s
        failed = False
        while self._pending is not None:
            value, version = self._pending, self._version
            try:
                await self._write(value)
            except DynamoError as exc:
                self.last_error = exc
                failed = True
                logger.debug("discovery write failed what=%s error=%s retry_in_s=%.2f", self.what, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
                continue
            if self._version == version:
                self._pending = None
            self._written_version = max(self._written_version, version)
            self._changed.set()
            if failed:
                logger.info("discovery write landed after retries what=%s", self.what)
                failed = False
            delay = self._retry_min_s
