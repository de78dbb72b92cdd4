"""``connect_within``: a first NATS connection's deadline holds even when the library swallows the
cancellation (nats-py does, in its flush; its connect loop then retried a refusing server for
ever). The stand-ins below behave as nats-py's connect did; the real client is covered by the
NATS integration tests."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamod.shared.transport.nats_connect import connect_within


class StubbornClient:
    """A connect that retries for ever, swallows ``swallow`` cancellations, and stops once closed."""

    def __init__(self, swallow: int) -> None:
        self.swallow = swallow
        self.closed = False
        self.attempts = 0

    async def connect(self) -> str:
        while not self.closed:
            self.attempts += 1
            try:
                await asyncio.sleep(0.05)  # a refused attempt, then the next
            except asyncio.CancelledError:
                if self.swallow <= 0:
                    raise
                self.swallow -= 1
        raise ConnectionError("closed while connecting")

    async def close(self) -> None:
        self.closed = True


async def test_a_connect_that_swallows_its_cancellation_is_stopped_by_closing_the_client() -> None:
    client = StubbornClient(swallow=10**9)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await connect_within(client.connect(), 0.3, client.close)
    assert time.monotonic() - start < 2.0
    assert client.closed
    attempts = client.attempts
    await asyncio.sleep(0.2)
    assert client.attempts == attempts  # no retry loop left running


async def test_a_connect_that_honours_cancellation_is_not_closed() -> None:
    client = StubbornClient(swallow=0)
    with pytest.raises(TimeoutError):
        await connect_within(client.connect(), 0.2, client.close)
    assert not client.closed


async def test_success_and_errors_of_the_attempt_come_through() -> None:
    async def ok() -> str:
        await asyncio.sleep(0.01)
        return "nc"

    async def refused() -> str:
        raise PermissionError("authorization violation")

    async def never_close() -> None:
        raise AssertionError("a finished attempt is not closed")

    assert await connect_within(ok(), 1.0, never_close) == "nc"
    with pytest.raises(PermissionError, match="authorization"):
        await connect_within(refused(), 1.0, never_close)


async def test_an_attempt_that_connects_past_the_deadline_is_closed() -> None:
    closed: list[bool] = []

    async def late() -> str:
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            return "connected anyway"  # the cancellation arrived as the connection completed
        return "nc"

    async def close() -> None:
        closed.append(True)

    with pytest.raises(TimeoutError):
        await connect_within(late(), 0.05, close)
    assert closed == [True]
