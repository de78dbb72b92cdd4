"""A decode worker's agent is connected to each prefill worker's agent as it appears in discovery
(shared/kv/transfer/peer_warmer.py), on the real file backend and real agents over each backend:
published before or after the warmer starts, a peer that cannot be reached is logged and left to
the first read, and a read after the connection works as before."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.kv.transfer.directory import KvTransferDirectory
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.peer_warmer import PeerWarmer
from tests.fixtures.servers import free_port
from tests.unit.kv_transfer.support import BACKENDS, eventually, fill, started_agent

NS = "dyn"
BLOCKS, BLOCK_BYTES = 32, 4096


@pytest.fixture
async def store(tmp_path):
    s = FileStore(str(tmp_path / "kv"))
    await s.start()
    yield s
    await s.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_prefill_agents_are_connected_as_they_appear(store, backend, caplog) -> None:
    caplog.set_level(logging.INFO, logger="dynamod.shared.kv.transfer.peer_warmer")
    lease = await store.create_lease(10.0)
    directory = KvTransferDirectory(store, NS)
    first = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), backend, worker_id=0xA1)
    second = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), backend, worker_id=0xA2)
    reader = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), backend, worker_id=0xD1)
    warmer = PeerWarmer(reader, directory, "prefill", timeout_s=5.0)
    try:
        await directory.publish("prefill", first.metadata(), lease)  # before the decode worker starts
        await warmer.start()
        await eventually(lambda: warmer.connected == 1, what="the published prefill agent connected")
        await directory.publish("prefill", second.metadata(), lease)  # a prefill worker scaled up later
        await eventually(lambda: warmer.connected == 2, what="the new prefill agent connected")
        connected = [r.getMessage() for r in caplog.records if "kv_transfer.peer_connected" in r.getMessage()]
        assert any(f"worker_id={0xA2:016x}" in line and f"backend={backend}" in line for line in connected)
        # A peer whose advertised address takes no connection: said once, nothing else breaks.
        gone = msgspec.structs.replace(second.metadata(), worker_id=0xA3, agent_name="gone", address=f"127.0.0.1:{free_port()}")
        await directory.publish("prefill", gone, lease)
        await eventually(
            lambda: any("kv_transfer.peer_connect_failed" in r.getMessage() for r in caplog.records), what="the failure logged"
        )
        assert warmer.connected == 2
        # Reads over the prepared connection move the right bytes.
        fill(second.memory, seed=5)
        result = await reader.read_blocks(second.metadata(), [3, 4], [7, 8], timeout_s=5.0)
        assert result.num_blocks == 2
        assert (reader.memory.array[7:9] == second.memory.array[3:5]).all()
        await directory.withdraw("prefill", 0xA2)  # withdrawn: forgotten, no error
        await asyncio.sleep(0.05)
    finally:
        await warmer.close()
        await directory.close()
        for agent in (reader, second, first):
            await agent.close()


async def test_follow_tells_a_listener_the_records_a_lookup_already_seeded(store) -> None:
    lease = await store.create_lease(10.0)
    directory = KvTransferDirectory(store, NS)
    agent = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), "tcp", worker_id=0xB1)
    try:
        await directory.publish("prefill", agent.metadata(), lease)
        assert (await directory.lookup(0xB1)).agent_name == agent.metadata().agent_name  # starts the watch
        heard: list[tuple[str, str | None]] = []
        await directory.follow("prefill", lambda key, meta: heard.append((key, None if meta is None else meta.agent_name)))
        assert [name for _, name in heard] == [agent.metadata().agent_name]
        await directory.withdraw("prefill", 0xB1)
        await eventually(lambda: heard[-1][1] is None, what="the withdrawal heard")
    finally:
        await directory.close()
        await agent.close()

