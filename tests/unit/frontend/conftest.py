"""The frontend tests' in-process cluster: the real frontend over mem discovery, no workers yet (each
test adds the fake workers it needs; see test_app.Cluster)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.unit.frontend.test_app import Cluster


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    await c.start()
    try:
        yield c
    finally:
        await c.stop()
