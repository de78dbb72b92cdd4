"""A first NATS connection with a deadline that holds, whatever nats-py does with cancellation.

``asyncio.wait_for(nc.connect(...), t)`` (or ``asyncio.timeout``) bounds the connect only if the
cancellation at the deadline reaches it. nats-py swallows ``CancelledError`` in a few of its
internal awaits (its pending-buffer flush, for one), and with ``max_reconnect_attempts=-1`` its
connect loop then goes on retrying a server that refuses us for ever: a process that should have
said "cannot connect" in 2 s hangs instead (seen in CI, on a loaded machine, against a server
that refused the credentials). So the connect runs as a task that is waited on with a deadline;
past it the task is cancelled again until it ends, and the client is closed, which ends any retry
loop that survived; only then does the caller get ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

CANCEL_TRIES = 20
CANCEL_WAIT_S = 0.1


async def connect_within(
    connect: Awaitable[Any], timeout_s: float, close: Callable[[], Awaitable[Any]], *, what: str = "nats"
) -> Any:
    """The result of ``connect``, or ``TimeoutError`` once ``timeout_s`` passed and the attempt
    is stopped for good (``close`` is the client's close: awaited, errors ignored). Errors of the
    attempt itself propagate as they are."""
    task = asyncio.ensure_future(connect)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await _stop(task, close, what)
        raise
    if done:
        return task.result()
    await _stop(task, close, what)
    raise TimeoutError(f"no connection within {timeout_s:g}s")


async def _stop(task: asyncio.Future[Any], close: Callable[[], Awaitable[Any]], what: str) -> None:
    for attempt in range(CANCEL_TRIES):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        if attempt == 0 and not task.done():
            # The library swallowed the cancellation: closing the client ends its retry loop.
            logger.info("%s connect ignored its cancellation action=close_client", what)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(close(), 2.0)
    if not task.done():
        logger.warning("%s connect attempt did not stop after close; abandoning it", what)
        return
    if task.cancelled():
        return
    if task.exception() is None:  # it connected just past the deadline: too late, let it go
        with contextlib.suppress(Exception):
            await asyncio.wait_for(close(), 2.0)
