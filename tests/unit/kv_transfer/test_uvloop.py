"""The daemons run on uvloop, whose transports are not ``asyncio.Transport`` subclasses: a TCP
block read must work there exactly as on the default loop."""

from __future__ import annotations

import asyncio

import uvloop

from dynamod.shared.kv.transfer.memory import KvBlockMemory
from tests.unit.kv_transfer.support import fill, started_agent


async def _read_once() -> tuple[int, int]:
    served = KvBlockMemory(8, 4096)
    fill(served, seed=7)
    local = KvBlockMemory(8, 4096)
    server = await started_agent(served, "tcp", worker_id=1)
    reader = await started_agent(local, "tcp", worker_id=2)
    notified: list[str] = []
    server.set_notify_callback(notified.append)
    try:
        result = await reader.read_blocks(server.metadata(), [1, 5, 6], [0, 1, 2], timeout_s=5.0, notify="t-1")
        deadline = asyncio.get_running_loop().time() + 5
        while not notified:  # noqa: ASYNC110 - a bounded wait for the notification
            assert asyncio.get_running_loop().time() < deadline, "notification never arrived"
            await asyncio.sleep(0.005)
        assert notified == ["t-1"]
        return result.num_blocks, local.checksum([0, 1, 2]) ^ served.checksum([1, 5, 6])
    finally:
        await reader.close()
        await server.close()


def test_tcp_read_under_uvloop() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        blocks, diff = runner.run(_read_once())
    assert (blocks, diff) == (3, 0)
