"""The KV block server serves prompt content: it admits readers as the request plane does.

Real agents on loopback; certificates and token from the operators' tool (``tests/fixtures/tls.py``).
A refused reader gets a ``KvTransferError`` that says why and not one block byte; every refusal is
counted in ``dynamo_component_request_plane_unauthenticated_total{transport="kv_transfer"}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from dynamod.shared.kv.transfer.base import KvTransferError
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.kv.transfer.tcp import TcpKvAgent
from dynamod.shared.kv.transfer.tcp_wire import (
    LENGTH,
    ReadRequest,
    encode_frame,
    reply_decoder,
    split_address,
)
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.security.tls import TlsFiles
from dynamod.shared.security.token import ClusterToken
from dynamod.shared.transport.liveness import RequestPlaneMetrics
from tests.fixtures.request_plane import unauthenticated
from tests.fixtures.started import started_by
from tests.fixtures.tls import ClusterCerts
from tests.unit.kv_transfer.support import fill

pytestmark = pytest.mark.timeout(60)

BLOCKS, BLOCK_BYTES = 8, 4096


class Serving:
    def __init__(self, security: RequestPlaneSecurity | None) -> None:
        self.registry = CollectorRegistry()
        memory = KvBlockMemory(BLOCKS, BLOCK_BYTES)
        fill(memory, seed=7)
        self.memory = memory
        self.agent = TcpKvAgent(memory, worker_id=1, security=security, metrics=RequestPlaneMetrics(self.registry))

    def rejected(self, reason: str) -> float:
        return unauthenticated(self.registry, "kv_transfer", reason)


@pytest.fixture
async def serving() -> AsyncIterator[Callable[[RequestPlaneSecurity | None], Awaitable[Serving]]]:
    async with started_by(Serving, lambda s: s.agent.start(), lambda s: s.agent.close()) as make:
        yield make


async def _read(server: Serving, security: RequestPlaneSecurity | None) -> np.ndarray:
    reader = TcpKvAgent(KvBlockMemory(BLOCKS, BLOCK_BYTES), worker_id=2, security=security)
    await reader.start()
    try:
        await reader.read_blocks(server.agent.metadata(), [1, 2, 5], [0, 1, 2], timeout_s=5)
        return reader.memory.array[:3].copy()
    finally:
        await reader.close()


async def test_token_admits_the_cluster_and_refuses_others(serving, cluster_certs: ClusterCerts) -> None:  # noqa: ANN001
    token = RequestPlaneSecurity(token=ClusterToken(cluster_certs.token))
    server = await serving(token)
    got = await _read(server, token)
    assert np.array_equal(got, server.memory.array[[1, 2, 5]])
    with pytest.raises(KvTransferError, match="refused the read: this server requires the cluster token"):
        await _read(server, None)
    assert server.rejected("missing_token") == 1
    with pytest.raises(KvTransferError, match="refused this worker.*does not match"):
        await _read(server, RequestPlaneSecurity(token=ClusterToken("y" * 43)))
    assert server.rejected("bad_token") == 1


async def test_a_raw_read_without_hello_gets_no_block_bytes(serving, cluster_certs: ClusterCerts) -> None:  # noqa: ANN001
    server = await serving(RequestPlaneSecurity(token=ClusterToken(cluster_certs.token)))
    host, port = split_address(server.agent.address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(encode_frame(ReadRequest([0, 1], BLOCK_BYTES)))
        await writer.drain()
        (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        reply = reply_decoder.decode(await reader.readexactly(length))
        assert reply.code == "unauthenticated"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, and nothing else was sent
    finally:
        writer.close()
    assert server.rejected("missing_token") == 1


async def test_an_open_server_answers_a_reader_with_a_token(serving, cluster_certs: ClusterCerts) -> None:  # noqa: ANN001
    """Rolling out the token: readers that already present it still read from open servers."""
    server = await serving(None)
    got = await _read(server, RequestPlaneSecurity(token=ClusterToken(cluster_certs.token)))
    assert np.array_equal(got, server.memory.array[[1, 2, 5]])


async def test_mutual_tls_admits_cluster_certificates_only(serving, cluster_certs: ClusterCerts) -> None:  # noqa: ANN001
    security = cluster_certs.request_plane()  # TLS with client certificates, and the token
    server = await serving(security)
    got = await _read(server, security)
    assert np.array_equal(got, server.memory.array[[1, 2, 5]])
    with pytest.raises(KvTransferError):  # plaintext: the TLS server drops it
        await _read(server, RequestPlaneSecurity(token=ClusterToken(cluster_certs.token)))
    rogue = RequestPlaneSecurity(
        tls=TlsFiles(cluster_certs.rogue_ca, cluster_certs.rogue_cert, cluster_certs.rogue_key),
        token=ClusterToken(cluster_certs.token),
    )
    with pytest.raises(KvTransferError, match="TLS with KV block server"):
        await _read(server, rogue)


async def test_metadata_advertises_a_dialable_address() -> None:
    agent = TcpKvAgent(KvBlockMemory(2, 1024), worker_id=3, host="0.0.0.0", advertise_host="10.9.8.7")
    await agent.start()
    try:
        assert agent.metadata().address.startswith("10.9.8.7:")
    finally:
        await agent.close()
    agent = TcpKvAgent(KvBlockMemory(2, 1024), worker_id=4, host="0.0.0.0")
    await agent.start()
    try:
        host, _ = split_address(agent.metadata().address)
        assert host not in ("0.0.0.0", "")
    finally:
        await agent.close()
