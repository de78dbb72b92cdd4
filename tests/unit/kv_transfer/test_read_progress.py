"""A NIXL agent runs without UCX's progress thread, and a READ between processes completes only
when the serving side progresses too: the serving agent drives its progress promptly while a READ
is expected (its block server just told a watcher that blocks are ready, or its engine handed out
transfer parameters), and slowly otherwise."""

from __future__ import annotations

import asyncio

import pytest

from dynamod.shared.kv.transfer.factory import nixl_unavailable_reason
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from tests.unit.kv_transfer.support import started_agent

ROWS = [4, 5, 6]


async def test_the_block_server_says_when_a_watch_is_answered_with_new_blocks() -> None:
    server = await started_agent(KvBlockMemory(16, 1024), "tcp", worker_id=0xA1)
    reader = await started_agent(KvBlockMemory(16, 1024), "tcp", worker_id=0xB2)
    told: list[int] = []
    server.set_blocks_ready_callback(lambda: told.append(1))  # type: ignore[attr-defined]
    try:
        readiness = server.memory.readiness
        readiness.open("t", ROWS, ready=1)
        got = await reader.watch(server.metadata(), ROWS, "t", 0, timeout_s=5, wait_ms=2000)  # type: ignore[attr-defined]
        assert got.ready == 1 and told == [1]  # a READ of the first block follows
        waiting = asyncio.create_task(
            reader.watch(server.metadata(), ROWS, "t", 1, timeout_s=5, wait_ms=2000)  # type: ignore[attr-defined]
        )
        await asyncio.sleep(0.05)
        assert told == [1]  # nothing new yet
        readiness.complete("t", server.memory.checksum(ROWS))
        assert (await waiting).ready == len(ROWS) and told == [1, 1]
    finally:
        await reader.close()
        await server.close()


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=f"NIXL unusable: {nixl_unavailable_reason()}")
async def test_a_nixl_agent_progresses_promptly_only_while_a_read_is_expected() -> None:
    agent = await started_agent(KvBlockMemory(16, 1024), "nixl", worker_id=0xA1)
    inner = agent._agent  # type: ignore[attr-defined]
    calls = [0]
    real = inner.get_new_notifs

    def counting() -> object:
        calls[0] += 1
        return real()

    inner.get_new_notifs = counting
    try:
        await asyncio.sleep(0.1)  # settle into the idle pace
        calls[0] = 0
        await asyncio.sleep(0.05)
        idle = calls[0]
        assert idle <= 4  # one poll per 20 ms at rest
        calls[0] = 0
        agent.expect_reads()
        await asyncio.sleep(0.01)
        assert calls[0] >= 3  # every ~0.5 ms while the READ may be in flight (at rest: one per 20 ms)
    finally:
        await agent.close()
