"""Dead peers on the TCP request plane: both ends of a connection probe their peer with TCP
keep-alive, so a stream to a machine that died fails within seconds and can migrate (a repair
found in review: each test fails without it)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from dynamod.shared.transport.plane import RequestContext
from tests.fixtures.request_plane import tcp_plane


def _keepalive_options(sock: socket.socket) -> tuple[int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    )


async def _request_plane_sockets_probe_their_peer() -> None:
    async def echo(body: object, ctx: RequestContext):
        yield body

    async with tcp_plane({"echo": echo}) as (server, address, client):
        assert [x async for x in client.stream(address, "echo", "hi")] == ["hi"]
        [client_conn] = list(client._conns.values())
        [server_conn] = list(server._connections)
        for conn in (client_conn, server_conn):
            assert conn._transport is not None
            enabled, idle, interval, probes = _keepalive_options(conn._transport.get_extra_info("socket"))
            assert enabled == 1
            # Declared dead within seconds, not after the kernel's default of over two hours.
            assert idle + interval * probes <= 15


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="keep-alive timing is tuned on Linux only")
async def test_request_plane_connections_use_tcp_keepalive() -> None:
    """A peer whose machine died never closes its connection: only keep-alive probes end it (in
    about idle + interval * probes seconds) so the stream fails and can migrate."""
    await _request_plane_sockets_probe_their_peer()


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="keep-alive timing is tuned on Linux only")
def test_request_plane_connections_use_tcp_keepalive_on_uvloop() -> None:
    """The daemons run uvloop, whose transports hand out their own socket objects."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_request_plane_sockets_probe_their_peer())
