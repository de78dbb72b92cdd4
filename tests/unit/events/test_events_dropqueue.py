"""The event plane's bounded queue: a slow consumer loses the oldest items, counted."""

from __future__ import annotations

import asyncio

import pytest

from dynamod.shared.events.dropqueue import DropOldestQueue, QueueClosed


async def test_full_queue_evicts_the_oldest_and_counts() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(3)
    results = [q.put_nowait(i) for i in range(5)]
    assert results == [True, True, True, False, False]
    assert q.dropped == 2 and q.put_count == 5 and len(q) == 3
    assert [await q.get() for _ in range(3)] == [2, 3, 4]


async def test_get_waits_for_a_put() -> None:
    q: DropOldestQueue[str] = DropOldestQueue(2)
    getter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    assert not getter.done()
    q.put_nowait("x")
    assert await asyncio.wait_for(getter, 1) == "x"


async def test_push_front_keeps_the_retried_item_first() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(3)
    for i in (1, 2, 3):
        q.put_nowait(i)
    item = q.get_nowait()
    q.put_nowait(4)
    q.push_front(item)  # full again: the newest gives way so the order of the rest is kept
    assert q.dropped == 1
    assert [q.get_nowait() for _ in range(3)] == [1, 2, 3]


async def test_close_wakes_a_waiting_consumer() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(2)
    getter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    q.close()
    with pytest.raises(QueueClosed):
        await asyncio.wait_for(getter, 1)
    q.put_nowait(1)  # ignored after close
    assert len(q) == 0


def test_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        DropOldestQueue(0)
