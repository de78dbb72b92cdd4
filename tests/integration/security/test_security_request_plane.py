"""The request plane's door: the cluster token and (mutual) TLS, checked before anything is served.

Server and clients are real TCP endpoints on loopback; the certificates come from the same tool
operators use (``tests/fixtures/tls.py``). Every refusal must leave the handler untouched, reach the
client as a clear error, and be counted in ``dynamo_component_request_plane_unauthenticated_total``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dynamod.shared.errors import ConfigError, TransportError, UnauthenticatedError
from dynamod.shared.security.settings import RequestPlaneSecurity
from dynamod.shared.security.tls import TlsFiles
from dynamod.shared.security.token import ClusterToken
from dynamod.shared.transport.framing import HEADER, ClientFrame, ServerFrame, encode_frame
from dynamod.shared.transport.liveness import RequestPlaneMetrics
from dynamod.shared.transport.plane import RequestContext
from dynamod.shared.transport.tcp_client import TcpRequestClient, parse_host_port
from dynamod.shared.transport.tcp_server import TcpRequestServer
from tests.fixtures.request_plane import unauthenticated
from tests.fixtures.servers import poll
from tests.fixtures.started import started_by
from tests.fixtures.tls import ClusterCerts

pytestmark = pytest.mark.timeout(60)

ENDPOINT = "dynamo/backend/generate/1"


class Served:
    """A server with one echo endpoint that remembers every request it ran."""

    def __init__(self, security: RequestPlaneSecurity | None) -> None:
        self.registry = CollectorRegistry()
        self.server = TcpRequestServer(security=security, metrics=RequestPlaneMetrics(self.registry))
        self.calls: list[Any] = []

        async def echo(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
            self.calls.append(body)
            yield {"echo": body}

        self.server.register(ENDPOINT, echo)

    def rejected(self, reason: str) -> float:
        return unauthenticated(self.registry, "tcp", reason)


@pytest.fixture
async def make_server() -> AsyncIterator[Callable[[RequestPlaneSecurity | None], Awaitable[Served]]]:
    async with started_by(Served, lambda s: s.server.start(), lambda s: s.server.stop(grace_s=0)) as make:
        yield make


async def call(security: RequestPlaneSecurity | None, served: Served, body: Any = "hi") -> list[Any]:
    client = TcpRequestClient(security=security)
    try:
        address = served.server.address
        assert address is not None
        return [item async for item in client.stream(address, ENDPOINT, body, timeout_s=10)]
    finally:
        await client.close()


async def test_token_lets_members_in_and_keeps_others_out(make_server, cluster_certs: ClusterCerts) -> None:
    token_only = cluster_certs.request_plane(tls=False)
    served = await make_server(token_only)
    assert await call(token_only, served, "member") == [{"echo": "member"}]

    with pytest.raises(UnauthenticatedError, match="requires the cluster token"):
        await call(None, served, "stranger")
    wrong = RequestPlaneSecurity(token=ClusterToken("x" * 43))
    with pytest.raises(UnauthenticatedError, match="does not match"):
        await call(wrong, served, "guesser")

    assert served.calls == ["member"]  # the refused requests never reached the handler
    assert served.rejected("missing_token") == 1
    assert served.rejected("bad_token") == 1
    await poll(lambda: _no_connections(served), 5, "refused connections closed")


async def _no_connections(served: Served) -> bool:
    # One connection of the member's client was closed with it; refused ones are closed by the server.
    return served.server.stats()["connections"] == 0


async def test_mutual_tls_requires_a_cluster_certificate(make_server, cluster_certs: ClusterCerts) -> None:
    mtls = cluster_certs.request_plane(token=False)
    served = await make_server(mtls)
    assert await call(mtls, served, "member") == [{"echo": "member"}]

    no_cert = cluster_certs.request_plane(token=False, client_cert=False)
    with pytest.raises(UnauthenticatedError, match="CERTIFICATE_REQUIRED"):
        await call(no_cert, served, "no-cert")
    rogue = RequestPlaneSecurity(tls=TlsFiles(cluster_certs.ca, cluster_certs.rogue_cert, cluster_certs.rogue_key))
    with pytest.raises(UnauthenticatedError, match="UNKNOWN_CA"):
        await call(rogue, served, "rogue-cert")
    with pytest.raises((TransportError, UnauthenticatedError)):
        await call(None, served, "plaintext")

    assert served.calls == ["member"]
    await poll(lambda: _count(served, "tls_handshake", 3), 5, "three failed TLS handshakes counted")


async def _count(served: Served, reason: str, n: int) -> bool:
    return served.rejected(reason) >= n


async def test_client_refuses_a_server_outside_the_cluster(make_server, cluster_certs: ClusterCerts) -> None:
    impostor = await make_server(
        RequestPlaneSecurity(tls=TlsFiles(cluster_certs.rogue_ca, cluster_certs.rogue_cert, cluster_certs.rogue_key))
    )
    with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
        await call(cluster_certs.request_plane(), impostor, "secret prompt")
    assert impostor.calls == []


async def test_tls_and_token_together_and_pipelined_requests(make_server, cluster_certs: ClusterCerts) -> None:
    both = cluster_certs.request_plane()
    served = await make_server(both)
    client = TcpRequestClient(security=both)
    try:
        address = served.server.address
        assert address is not None

        async def one(i: int) -> list[Any]:
            return [item async for item in client.stream(address, ENDPOINT, i, timeout_s=10)]

        # Ten streams opened at once ride behind the hello on the first connection.
        results = await asyncio.gather(*(one(i) for i in range(10)))
    finally:
        await client.close()
    assert results == [[{"echo": i}] for i in range(10)]
    assert served.rejected("missing_token") == served.rejected("bad_token") == 0


def _raw_connect(served: Served) -> socket.socket:
    address = served.server.address
    assert address is not None
    sock = socket.create_connection(parse_host_port(address.address), timeout=5)
    return sock


def _read_frames(sock: socket.socket) -> list[ServerFrame]:
    import msgspec

    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    frames = []
    while len(data) >= 4:
        (size,) = HEADER.unpack_from(data, 0)
        frames.append(msgspec.msgpack.decode(data[4 : 4 + size], type=ServerFrame))
        data = data[4 + size :]
    return frames


async def test_a_request_without_hello_is_refused_and_nothing_dispatched(make_server, cluster_certs) -> None:
    served = await make_server(cluster_certs.request_plane(tls=False))

    def knock() -> list[ServerFrame]:
        with _raw_connect(served) as sock:
            sock.sendall(encode_frame(ClientFrame(1, endpoint=ENDPOINT, body="sneaky", credit=8), 1 << 20))
            return _read_frames(sock)

    frames = await asyncio.to_thread(knock)
    assert len(frames) == 1 and frames[0].stream_id == 0
    assert frames[0].error["code"] == "unauthenticated"  # type: ignore[index]
    assert served.calls == []


async def test_a_huge_first_frame_is_refused_without_being_read(make_server, cluster_certs) -> None:
    served = await make_server(cluster_certs.request_plane(tls=False))

    def knock() -> list[ServerFrame]:
        with _raw_connect(served) as sock:
            sock.sendall(HEADER.pack(512 * 1024 * 1024) + b"\0" * 1024)  # claims 512 MiB
            return _read_frames(sock)

    frames = await asyncio.to_thread(knock)
    assert [f.error["code"] for f in frames] == ["unauthenticated"]  # type: ignore[index]
    assert served.rejected("missing_token") == 1


async def test_a_silent_peer_is_closed_after_the_handshake_timeout(make_server, cluster_certs) -> None:
    served = await make_server(cluster_certs.request_plane(tls=False))
    served.server.guard.handshake_timeout_s = 0.3

    def knock() -> list[ServerFrame]:
        with _raw_connect(served) as sock:
            return _read_frames(sock)  # sends nothing; returns when the server closes

    frames = await asyncio.to_thread(knock)
    assert [f.error["code"] for f in frames] == ["unauthenticated"]  # type: ignore[index]
    assert served.rejected("handshake_timeout") == 1


def test_token_and_tls_under_uvloop(cluster_certs: ClusterCerts) -> None:
    """Daemons run uvloop, whose start_tls and SSL transports are its own implementation."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        both = cluster_certs.request_plane()
        served = Served(both)
        await served.server.start()
        try:
            assert await call(both, served, "uv") == [{"echo": "uv"}]
            with pytest.raises(UnauthenticatedError):
                await call(cluster_certs.request_plane(client_cert=False), served, "no-cert")
            with pytest.raises(UnauthenticatedError):
                await call(cluster_certs.request_plane(token=False), served, "no-token")
            assert served.calls == ["uv"]
        finally:
            await served.server.stop(grace_s=0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


def test_bad_settings_are_one_clear_error(cluster_certs: ClusterCerts, tmp_path) -> None:
    with pytest.raises(ConfigError, match="at least 16 characters"):
        ClusterToken("short")
    with pytest.raises(ConfigError, match="does not exist"):
        TcpRequestServer(security=RequestPlaneSecurity(tls=TlsFiles(str(tmp_path / "nope.pem"))))
    with pytest.raises(ConfigError, match="needs a certificate"):
        TcpRequestServer(security=RequestPlaneSecurity(tls=TlsFiles(cluster_certs.ca)))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot load certificate"):
        TcpRequestServer(security=RequestPlaneSecurity(tls=TlsFiles(cluster_certs.ca, str(garbage), str(garbage))))
