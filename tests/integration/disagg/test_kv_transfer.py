"""KV block reads from a serving agent in another process, over each backend.

What a decode worker relies on: the bytes it reads equal the prefill worker's, the prefill worker
hears that the read finished, a frozen prefill worker costs one deadline, and a prefill worker that
dies mid-transfer is a ``KvTransferError`` (so the decode worker can prefill locally)."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

from dynamod.shared.kv.transfer.base import KvTransferError, KvTransferTimeout
from dynamod.shared.kv.transfer.factory import nixl_unavailable_reason
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from tests.unit.kv_transfer.support import BACKENDS, PeerProcess, eventually, started_agent

BLOCK_BYTES = 64 * 1024


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def peers():
    started: list[PeerProcess] = []

    def spawn(
        backend: str,
        blocks: int,
        block_bytes: int = BLOCK_BYTES,
        seed: int = 3,
        env: dict[str, str] | None = None,
    ) -> PeerProcess:
        peer = PeerProcess(backend, blocks, block_bytes, seed, env)
        started.append(peer)
        return peer

    yield spawn
    for peer in started:
        peer.cleanup()


@pytest.mark.parametrize("count", [1, 16, 256])
async def test_blocks_read_from_another_process_are_its_bytes(backend: str, peers, count: int) -> None:
    peer = peers(backend, 256)
    meta = await peer.ready()
    assert meta.backend == backend
    reader = await started_agent(KvBlockMemory(600, BLOCK_BYTES), backend, worker_id=0xD)
    try:
        remote_ids = list(range(count - 1, -1, -1))
        local_ids = [(10 + 2 * i) % 600 for i in range(count)]
        result = await reader.read_blocks(meta, remote_ids, local_ids, timeout_s=20, notify=f"done-{count}")
        assert result.backend == backend
        assert np.array_equal(reader.memory.array[local_ids], peer.expected(remote_ids))
        assert await peer.next_notification() == f"done-{count}"
        await reader.notify(meta, "standalone", timeout_s=5)
        assert await peer.next_notification() == "standalone"
    finally:
        await reader.close()


async def test_a_frozen_peer_costs_one_deadline_and_then_recovers(
    backend: str, peers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over UCX's TCP transport a read needs the peer's progress, as it would between hosts
    without RDMA. (Shared-memory transports on one host read a frozen process's memory without
    it: see the next test.)"""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    peer = peers(backend, 32, env={"UCX_TLS": "tcp,self"})
    meta = await peer.ready()
    reader = await started_agent(KvBlockMemory(32, BLOCK_BYTES), backend, worker_id=0xD)
    try:
        await reader.read_blocks(meta, [0], [0], timeout_s=20)  # connected before the freeze
        peer.signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(KvTransferTimeout, match="did not finish within 1.0s"):
            await reader.read_blocks(meta, list(range(32)), list(range(32)), timeout_s=1.0, notify="frozen")
        assert time.monotonic() - started < 2.5
        peer.signal(signal.SIGCONT)
        await reader.read_blocks(meta, list(range(32)), list(range(32)), timeout_s=20)
        assert np.array_equal(reader.memory.array[:32], peer.expected(list(range(32))))
    finally:
        await reader.close()


async def test_a_frozen_peer_on_shared_memory_never_holds_a_read_past_its_deadline(peers) -> None:
    """NIXL with UCX's default transports on one host: small reads of a frozen process's memory may
    complete (one-sided, the bytes are right), larger ones need its progress and time out. Either
    way the read returns by its deadline with correct bytes or ``KvTransferTimeout``."""
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(f"NIXL unusable: {reason}")
    blocks, block_bytes = 16, 2 << 20
    peer = peers("nixl", blocks, block_bytes)
    meta = await peer.ready()
    reader = await started_agent(KvBlockMemory(blocks, block_bytes), "nixl", worker_id=0xD)
    ids = list(range(blocks))
    try:
        await reader.read_blocks(meta, [0], [0], timeout_s=20)
        peer.signal(signal.SIGSTOP)
        for count in (1, blocks):
            started = time.monotonic()
            try:
                await reader.read_blocks(meta, ids[:count], ids[:count], timeout_s=1.0)
            except KvTransferTimeout:
                pass
            else:
                assert np.array_equal(reader.memory.array[:count], peer.expected(ids[:count]))
            assert time.monotonic() - started < 2.5
    finally:
        await reader.close()


async def test_a_peer_killed_mid_transfer_is_a_transfer_error(backend: str, peers) -> None:
    """The peer is frozen once the first bytes have arrived, so the kill lands mid-transfer."""
    blocks, block_bytes = 256, 1 << 20
    peer = peers(backend, blocks, block_bytes)
    meta = await peer.ready(timeout=60)
    reader = await started_agent(KvBlockMemory(blocks, block_bytes), backend, worker_id=0xD)
    ids = list(range(blocks))
    try:
        await reader.read_blocks(meta, [0], [0], timeout_s=20)
        reader.memory.array[0] = 0
        read = asyncio.create_task(reader.read_blocks(meta, ids, ids, timeout_s=30, notify="never"))
        await eventually(
            lambda: reader.memory.array[:, :64].any() or read.done(), timeout=20, what="first bytes"
        )
        peer.signal(signal.SIGSTOP)
        if read.done():
            pytest.fail("the whole read finished before the peer could be frozen; use more blocks")
        peer.signal(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(KvTransferError) as caught:
            await read
        assert not isinstance(caught.value, KvTransferTimeout)
        assert time.monotonic() - started < 10
    finally:
        await reader.close()
