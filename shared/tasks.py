"""Stopping a background task from the code that owns it.

``task.cancel()`` followed by ``await task`` raises ``CancelledError`` for two different reasons:
the task ended because we cancelled it (expected, to be swallowed) or the caller itself was
cancelled while it waited (not ours to absorb: swallowing it would let a cancelled shutdown carry
on as if nothing happened). ``Task.cancelling()`` tells the two apart. This module sits below
discovery, events and the engines so that every owner of a loop task stops it the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancels ``task`` and waits for it to end, swallowing its own cancellation only.

    The caller's cancellation (it was cancelled while waiting here) propagates. A task that stops
    itself (it is the current task) is not awaited: a task cannot wait for its own end.
    """
    current = asyncio.current_task()
    if task is None or task is current:
        return
    task.cancel()
    cancelling = current.cancelling() if current is not None else 0
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > cancelling:
            raise
