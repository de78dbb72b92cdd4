"""Streamed reads (KV transfer overlapped with the prefill): a reader asks for a transfer's blocks
before the serving side has computed them all; the server sends each as it becomes ready, fails
the read when the prefill is aborted, and gives up at the read's deadline. Over each backend: a
NIXL agent streams over its TCP block server (a one-sided READ cannot wait)."""

from __future__ import annotations

import asyncio

import pytest

from dynamod.shared.kv.transfer.base import KvTransferError, KvTransferTimeout
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.readiness import BlockReadiness, TransferNotReady
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata
from tests.unit.kv_transfer.support import BACKENDS, eventually, started_agent

BLOCK_BYTES = 4096
BLOCKS = 64
ROWS = [10, 11, 12, 13, 20, 21, 22, 23]  # a prompt's blocks, in order (two runs)


@pytest.fixture(params=BACKENDS)
async def pair(request):
    server = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), request.param, worker_id=0xA1)
    reader = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), request.param, worker_id=0xB2)
    yield server, reader
    await reader.close()
    await server.close()


def compute(memory: KvBlockMemory, rows: list[int], value: int) -> None:
    """What a prefill chunk does: writes the rows' final bytes."""
    for r in rows:
        memory.array[r] = value + r


async def test_rows_not_ready_are_waited_for_and_streamed_in_order(pair) -> None:
    server, reader = pair
    mem = server.memory
    readiness = mem.readiness
    compute(mem, ROWS[:2], 100)
    readiness.open("t1", ROWS, ready=2)  # a cached prefix: ready at once
    local = list(range(30, 30 + len(ROWS)))
    read = asyncio.create_task(
        reader.read_blocks(server.metadata(), ROWS, local, timeout_s=10, transfer_id="t1", streamed=True, notify="t1|8")
    )
    # The ready rows arrive while the rest are still being computed.
    await eventually(lambda: (reader.memory.array[30:32] == mem.array[ROWS[:2]]).all(), what="the ready prefix")
    assert not read.done()
    compute(mem, ROWS[2:5], 100)
    readiness.advance("t1", 5)
    await eventually(lambda: (reader.memory.array[30:35] == mem.array[ROWS[:5]]).all(), what="the next chunk")
    assert not read.done()
    compute(mem, ROWS[5:], 100)
    readiness.advance("t1", len(ROWS))  # capped: the last row waits for complete()
    await asyncio.sleep(0.05)
    assert not read.done()
    checksum = mem.checksum(ROWS)
    readiness.complete("t1", checksum, ready_at=1234.5)
    result = await asyncio.wait_for(read, 5)
    assert reader.memory.checksum(local) == checksum
    assert result.checksum == checksum and result.ready_at == 1234.5
    assert result.num_blocks == len(ROWS)


async def test_a_suffix_of_the_transfer_can_be_streamed(pair) -> None:
    """The decode worker skips the blocks it caches: it reads the rest of the rows."""
    server, reader = pair
    mem = server.memory
    compute(mem, ROWS, 7)
    mem.readiness.open("t2", ROWS, ready=3)
    read = asyncio.create_task(
        reader.read_blocks(server.metadata(), ROWS[4:], [40, 41, 42, 43], timeout_s=10, transfer_id="t2", streamed=True)
    )
    await asyncio.sleep(0.05)
    assert not read.done()
    mem.readiness.complete("t2", mem.checksum(ROWS))
    result = await asyncio.wait_for(read, 5)
    assert (reader.memory.array[40:44] == mem.array[ROWS[4:]]).all()
    assert result.checksum == mem.checksum(ROWS) and result.ready_at > 0


async def test_an_aborted_prefill_fails_the_waiting_reader(pair) -> None:
    server, reader = pair
    mem = server.memory
    mem.readiness.open("t3", ROWS, ready=1)
    read = asyncio.create_task(
        reader.read_blocks(server.metadata(), ROWS, ROWS, timeout_s=10, transfer_id="t3", streamed=True)
    )
    await asyncio.sleep(0.05)
    assert mem.readiness.fail("t3", "prefill aborted")
    with pytest.raises(KvTransferError, match="prefill aborted"):
        await asyncio.wait_for(read, 5)
    # The connection stays usable: a plain read over the same pool succeeds.
    result = await reader.read_blocks(server.metadata(), [1, 2], [1, 2], timeout_s=5)
    assert result.num_blocks == 2


async def test_rows_not_ready_by_the_deadline_fail_the_read(pair) -> None:
    server, reader = pair
    server.memory.readiness.open("t4", ROWS, ready=2)
    with pytest.raises(KvTransferError):
        await reader.read_blocks(server.metadata(), ROWS, ROWS, timeout_s=0.3, transfer_id="t4", streamed=True)
    assert server.memory.readiness.get("t4") is not None  # the transfer itself is still open


async def test_a_streamed_read_of_an_unknown_transfer_is_refused(pair) -> None:
    server, reader = pair
    with pytest.raises(KvTransferError, match="no open transfer"):
        await reader.read_blocks(server.metadata(), ROWS, ROWS, timeout_s=5, transfer_id="gone", streamed=True)


async def test_rows_outside_the_transfer_are_refused(pair) -> None:
    server, reader = pair
    server.memory.readiness.open("t5", ROWS, ready=8)
    with pytest.raises(KvTransferError, match="not rows of transfer"):
        await reader.read_blocks(server.metadata(), [10, 50], [1, 2], timeout_s=5, transfer_id="t5", streamed=True)


async def test_readiness_deadline_and_failure_without_a_server() -> None:
    readiness = BlockReadiness()
    progress = readiness.open("x", [1, 2, 3])
    loop = asyncio.get_running_loop()
    with pytest.raises(TransferNotReady) as info:
        await progress.changed(loop.time() + 0.05)
    assert not info.value.failed
    waiter = asyncio.create_task(progress.changed(loop.time() + 5))
    await asyncio.sleep(0)
    readiness.advance("x", 1)
    await asyncio.wait_for(waiter, 1)
    assert progress.ready == 1
    readiness.advance("x", 0)  # never moves back
    assert progress.ready == 1
    waiter = asyncio.create_task(progress.changed(loop.time() + 5))
    await asyncio.sleep(0)
    readiness.close("x")
    with pytest.raises(TransferNotReady) as info:
        await asyncio.wait_for(waiter, 1)
    assert info.value.failed and readiness.get("x") is None and len(readiness) == 0


async def test_heartbeats_keep_a_slow_prefill_alive_and_silence_fails_the_read(pair) -> None:
    """The reader's idle deadline is shorter than the prefill: heartbeats keep the read going; a
    server that goes silent (stalled) fails it after the idle deadline, not the whole budget."""
    server, reader = pair
    mem = server.memory
    compute(mem, ROWS, 3)
    mem.readiness.open("t6", ROWS, ready=0)
    read = asyncio.create_task(reader.read_blocks(
        server.metadata(), ROWS, ROWS, timeout_s=10, transfer_id="t6", streamed=True, idle_timeout_s=0.6,
    ))
    await asyncio.sleep(1.2)  # twice the idle deadline, with heartbeats flowing
    assert not read.done()
    mem.readiness.complete("t6", mem.checksum(ROWS))
    assert (await asyncio.wait_for(read, 5)).checksum == mem.checksum(ROWS)


async def test_a_silent_server_fails_a_streamed_read_at_the_idle_deadline() -> None:
    """A peer that accepts the read and then says nothing (frozen): KvTransferTimeout after the
    idle deadline, well before the read's whole budget."""
    reader = await started_agent(KvBlockMemory(BLOCKS, BLOCK_BYTES), "tcp", worker_id=0xB3)
    held: list[asyncio.StreamWriter] = []

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)
        await r.read()  # reads the request and never answers

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    meta = KvTransferMetadata(worker_id=0xC1, backend="tcp", agent_name="silent", address=f"127.0.0.1:{port}",
                              num_blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        with pytest.raises(KvTransferTimeout, match="sent nothing"):
            await reader.read_blocks(meta, ROWS, ROWS, timeout_s=20, transfer_id="t", streamed=True, idle_timeout_s=0.4)
        assert loop.time() - began < 3
    finally:
        for w in held:
            w.close()
        srv.close()
        await reader.close()
