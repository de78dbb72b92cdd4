"""Discovery backends the runtime's watched sets are tested on: the in-process one and the file one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.discovery.store import DiscoveryStore


@pytest.fixture(params=["mem", "file"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[DiscoveryStore]:
    s: DiscoveryStore = MemStore() if request.param == "mem" else FileStore(str(tmp_path / "kv"), poll_interval_s=0.02)
    await s.start()
    yield s
    await s.close()
