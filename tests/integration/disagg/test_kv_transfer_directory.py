"""Transfer agents in discovery, on the real file backend: a decode worker finds the prefill
worker's agent, the lookup is cached, and a restarted or departed prefill worker is noticed."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.errors import NotFoundError
from dynamod.shared.kv.transfer.directory import KvTransferDirectory
from dynamod.shared.protocol.keys import kv_transfer_key
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata, decode_transfer_metadata
from tests.unit.kv_transfer.support import eventually

NS = "dyn"


def meta(worker_id: int, agent: str, port: int = 9000) -> KvTransferMetadata:
    return KvTransferMetadata(
        worker_id=worker_id,
        backend="nixl",
        agent_name=agent,
        address=f"127.0.0.1:{port}",
        num_blocks=64,
        block_bytes=4096,
        nixl_metadata=b"\x00\x01opaque",
        base_address=0x7F0000000000,
    )


class CountingStore(FileStore):
    """The file store, counting direct reads (a cached lookup makes none)."""

    gets = 0

    async def get(self, key: str) -> bytes | None:
        self.gets += 1
        return await super().get(key)


@pytest.fixture
async def stores(tmp_path):
    """(the prefill worker's store, the decode worker's store) on one directory."""
    prefill, decode = FileStore(str(tmp_path / "kv")), CountingStore(str(tmp_path / "kv"))
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await decode.close()
    await prefill.close()


async def test_publish_then_lookup_from_another_store(stores) -> None:
    prefill, decode = stores
    lease = await prefill.create_lease(5.0)
    published = KvTransferDirectory(prefill, NS)
    await published.publish("prefill", meta(0xAB, "ab-1"), lease)
    raw = await prefill.get(kv_transfer_key(NS, "prefill", 0xAB))
    assert raw is not None and decode_transfer_metadata(raw) == meta(0xAB, "ab-1")
    directory = KvTransferDirectory(decode, NS)
    try:
        assert await directory.lookup(0xAB) == meta(0xAB, "ab-1")
        await eventually(
            lambda: directory.cached(0xAB) is not None, what="the watch to fill the cache"
        )
        reads = decode.gets
        for _ in range(5):
            assert (await directory.lookup(0xAB)).agent_name == "ab-1"
        assert decode.gets == reads, "cached lookups must not read the store"
    finally:
        await directory.close()
        await published.close()


async def test_lookup_waits_for_a_worker_that_publishes_late(stores) -> None:
    prefill, decode = stores
    directory = KvTransferDirectory(decode, NS)
    try:
        with pytest.raises(NotFoundError, match="no KV transfer agent for worker cd in dyn/prefill"):
            await directory.lookup(0xCD, timeout_s=0.3)
        lease = await prefill.create_lease(5.0)
        await KvTransferDirectory(prefill, NS).publish("prefill", meta(0xCD, "cd-1"), lease)
        assert (await directory.lookup(0xCD, timeout_s=5.0)).agent_name == "cd-1"
    finally:
        await directory.close()


async def test_a_restarted_worker_replaces_the_cached_agent(stores) -> None:
    prefill, decode = stores
    lease = await prefill.create_lease(5.0)
    publisher = KvTransferDirectory(prefill, NS)
    await publisher.publish("prefill", meta(0xEF, "ef-old", 9000), lease)
    directory = KvTransferDirectory(decode, NS)
    try:
        assert (await directory.lookup(0xEF)).agent_name == "ef-old"
        await publisher.publish("prefill", meta(0xEF, "ef-new", 9001), lease)

        deadline = time.monotonic() + 5.0
        while (name := (await directory.lookup(0xEF)).agent_name) != "ef-new":
            assert time.monotonic() < deadline, f"lookup still returns {name} 5s after the re-put"
            await asyncio.sleep(0.02)
        assert (await directory.lookup(0xEF)).address == "127.0.0.1:9001"
    finally:
        await directory.close()


async def test_withdrawn_and_expired_agents_disappear(stores) -> None:
    prefill, decode = stores
    publisher = KvTransferDirectory(prefill, NS)
    lease = await prefill.create_lease(5.0)
    await publisher.publish("prefill", meta(0x11, "11-a"), lease)
    await publisher.publish("backend", meta(0x22, "22-a"), lease)
    directory = KvTransferDirectory(decode, NS)
    try:
        assert (await directory.lookup(0x11)).agent_name == "11-a"
        assert (await directory.lookup(0x22, "backend")).agent_name == "22-a"
        await publisher.withdraw("prefill", 0x11)
        await eventually(lambda: directory.cached(0x11) is None, what="the DELETE")
        with pytest.raises(NotFoundError):
            await directory.lookup(0x11, timeout_s=0.2)
        await lease.revoke()  # the worker stopped: every key under its lease goes
        await eventually(
            lambda: directory.cached(0x22, "backend") is None, what="the lease's keys to go"
        )
        with pytest.raises(NotFoundError):
            await directory.lookup(0x22, "backend", timeout_s=0.2)
    finally:
        await directory.close()
