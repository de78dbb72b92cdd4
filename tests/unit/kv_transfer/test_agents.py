"""Two agents in one process, over each backend: what the decode side relies on when it reads a
prefill worker's blocks (bytes equal, notification after the bytes, clear refusals)."""

from __future__ import annotations

import asyncio
import socket
import time

import msgspec
import pytest

from dynamod.shared.kv.transfer.base import KvTransferAgent, KvTransferError, KvTransferTimeout
from dynamod.shared.kv.transfer.factory import nixl_unavailable_reason
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.tcp import TcpKvAgent
from dynamod.shared.protocol.kv_transfer import BACKEND_NIXL, BACKEND_TCP
from tests.unit.kv_transfer.support import BACKENDS, eventually, fill, started_agent

BLOCK_BYTES = 8192
BLOCKS = 300


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
async def pair(backend: str):
    """(serving agent with filled memory and a list of its notifications, reading agent)."""
    server_mem = KvBlockMemory(BLOCKS, BLOCK_BYTES)
    fill(server_mem)
    server = await started_agent(server_mem, backend, worker_id=0xA1)
    reader = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), backend, worker_id=0xB2)
    notes: list[str] = []
    server.set_notify_callback(notes.append)
    yield server, reader, notes
    await reader.close()
    await server.close()


@pytest.mark.parametrize("count", [1, 16, 256])
async def test_read_copies_the_remote_bytes_and_then_notifies(pair, count: int) -> None:
    server, reader, notes = pair
    remote_ids = [(7 * i + 3) % BLOCKS for i in range(count)]  # scattered, not one run
    local_ids = list(range(BLOCKS - 1, BLOCKS - 1 - count, -1))
    result = await reader.read_blocks(
        server.metadata(), remote_ids, local_ids, timeout_s=10, notify=f"xfer-{count}"
    )
    assert reader.memory.checksum(local_ids) == server.memory.checksum(remote_ids)
    assert (result.num_blocks, result.num_bytes) == (count, count * BLOCK_BYTES)
    assert result.backend == server.backend and result.seconds > 0
    await eventually(lambda: notes == [f"xfer-{count}"], what="the read's notification")


async def test_notify_alone_reaches_the_callback(pair) -> None:
    server, reader, notes = pair
    await reader.notify(server.metadata(), "nothing-to-read", timeout_s=5)
    await eventually(lambda: notes == ["nothing-to-read"], what="the notification")


async def test_metadata_describes_the_agent(pair, backend: str) -> None:
    server, reader, _ = pair
    meta = server.metadata()
    assert meta.backend == backend and meta.worker_id == 0xA1
    assert meta.agent_name.startswith("a1-") and meta.agent_name != reader.metadata().agent_name
    assert (meta.num_blocks, meta.block_bytes) == (BLOCKS, BLOCK_BYTES)
    assert meta.address.startswith("127.0.0.1:")
    assert bool(meta.nixl_metadata) == (backend == BACKEND_NIXL)


async def test_reads_in_parallel_from_one_peer(pair) -> None:
    server, reader, _ = pair
    meta = server.metadata()
    chunks = [list(range(i * 30, i * 30 + 30)) for i in range(8)]
    await asyncio.gather(*(reader.read_blocks(meta, ids, ids, timeout_s=10) for ids in chunks))
    every = [b for ids in chunks for b in ids]
    assert reader.memory.checksum(every) == server.memory.checksum(every)


async def test_remote_ids_outside_the_remote_memory_are_refused(pair) -> None:
    server, reader, _ = pair
    with pytest.raises(KvTransferError, match=r"remote block ids \[300, 999\] are outside"):
        await reader.read_blocks(server.metadata(), [0, 300, 999], [0, 1, 2], timeout_s=5)


async def test_local_ids_outside_the_local_memory_are_refused(pair) -> None:
    server, reader, _ = pair
    with pytest.raises(KvTransferError, match=r"local block id 300 is outside \[0, 300\)"):
        await reader.read_blocks(server.metadata(), [0], [300], timeout_s=5)


async def test_lists_of_different_lengths_are_refused(pair) -> None:
    server, reader, _ = pair
    with pytest.raises(KvTransferError, match="same length"):
        await reader.read_blocks(server.metadata(), [0, 1], [0], timeout_s=5)


async def test_mismatched_block_size_is_refused(backend: str) -> None:
    server = await started_agent(KvBlockMemory(4, 4096), backend, worker_id=1)
    reader = await started_agent(KvBlockMemory(4, 8192), backend, worker_id=2)
    try:
        with pytest.raises(KvTransferError, match="block size mismatch.*4096-byte blocks, this worker 8192"):
            await reader.read_blocks(server.metadata(), [0], [0], timeout_s=5)
    finally:
        await reader.close()
        await server.close()


async def test_tcp_server_checks_ids_and_block_size_itself() -> None:
    """Stale or forged metadata must not make the server send memory it does not have."""
    server = await started_agent(KvBlockMemory(4, 4096), BACKEND_TCP, worker_id=1)
    reader = await started_agent(KvBlockMemory(64, 4096), BACKEND_TCP, worker_id=2)
    other = await started_agent(KvBlockMemory(4, 2048), BACKEND_TCP, worker_id=3)
    try:
        lying = msgspec.structs.replace(server.metadata(), num_blocks=64)
        with pytest.raises(
            KvTransferError, match=r"refused the read: block ids \[10\] are outside .*\[0, 4\)"
        ):
            await reader.read_blocks(lying, [1, 10], [1, 10], timeout_s=5)
        # the refused read left the pooled connection usable
        await reader.read_blocks(lying, [1, 2], [1, 2], timeout_s=5)
        lying_size = msgspec.structs.replace(other.metadata(), block_bytes=4096)
        with pytest.raises(KvTransferError, match="refused the read: block size mismatch"):
            await reader.read_blocks(lying_size, [0], [0], timeout_s=5)
    finally:
        for agent in (reader, server, other):
            await agent.close()


async def test_a_peer_that_never_answers_times_out_within_the_deadline(backend: str) -> None:
    """A stalled prefill worker: the socket accepts, nothing ever comes back."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = await started_agent(KvBlockMemory(4, 4096), BACKEND_TCP, worker_id=1)
    reader = await started_agent(KvBlockMemory(4, 4096), backend, worker_id=2)
    stalled = msgspec.structs.replace(server.metadata(), address=f"127.0.0.1:{listener.getsockname()[1]}")
    try:
        started = time.monotonic()
        with pytest.raises(KvTransferTimeout, match="did not finish within 0.5s"):
            await reader.read_blocks(stalled, [0], [0], timeout_s=0.5)
        assert 0.5 <= time.monotonic() - started < 1.5
        with pytest.raises(KvTransferTimeout):
            await reader.notify(stalled, "x", timeout_s=0.3)
    finally:
        listener.close()
        await reader.close()
        await server.close()


async def test_a_server_that_is_gone_is_a_transfer_error(backend: str) -> None:
    server = await started_agent(KvBlockMemory(4, 4096), BACKEND_TCP, worker_id=1)
    reader = await started_agent(KvBlockMemory(4, 4096), backend, worker_id=2)
    meta = server.metadata()
    await server.close()
    try:
        with pytest.raises(KvTransferError, match=f"cannot connect to KV block server {meta.address}"):
            await reader.read_blocks(meta, [0], [0], timeout_s=5)
    finally:
        await reader.close()


async def test_a_pooled_connection_to_a_restarted_server_is_redialled() -> None:
    mem = KvBlockMemory(8, 4096)
    fill(mem, seed=5)
    first = await started_agent(mem, BACKEND_TCP, worker_id=1)
    reader = await started_agent(KvBlockMemory(8, 4096), BACKEND_TCP, worker_id=2)
    meta = first.metadata()
    port = int(meta.address.rsplit(":", 1)[1])
    await reader.read_blocks(meta, [0], [0], timeout_s=5)
    await first.close()
    second = TcpKvAgent(mem, worker_id=1, port=port)
    await second.start()
    try:
        await reader.read_blocks(second.metadata(), [1, 2], [1, 2], timeout_s=5)
        assert reader.memory.checksum([0, 1, 2]) == mem.checksum([0, 1, 2])
    finally:
        await reader.close()
        await second.close()


@pytest.mark.parametrize(("reader_backend", "server_backend"), [("tcp", "nixl"), ("nixl", "tcp")])
async def test_nixl_and_tcp_agents_read_each_other_over_tcp(reader_backend: str, server_backend: str) -> None:
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(f"NIXL unusable: {reason}")
    mem = KvBlockMemory(16, 4096)
    fill(mem, seed=9)
    server: KvTransferAgent = await started_agent(mem, server_backend, worker_id=1)
    reader: KvTransferAgent = await started_agent(KvBlockMemory(16, 4096), reader_backend, worker_id=2)
    notes: list[str] = []
    server.set_notify_callback(notes.append)
    try:
        result = await reader.read_blocks(server.metadata(), [3, 4, 5], [0, 1, 2], timeout_s=5, notify="t")
        assert result.backend == BACKEND_TCP
        assert reader.memory.checksum([0, 1, 2]) == mem.checksum([3, 4, 5])
        await eventually(lambda: notes == ["t"], what="the notification over TCP")
    finally:
        await reader.close()
        await server.close()
