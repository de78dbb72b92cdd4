"""Waiting for a watched set to catch up, with a deadline (never a bare sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    """Waits for ``predicate()`` (the watch delivers asynchronously); fails after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
