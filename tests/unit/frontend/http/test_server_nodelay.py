"""Every connection the HTTP server accepts has Nagle off, whether the listening socket passed
``TCP_NODELAY`` down (Linux) or the protocol had to set it per connection.

The check reads the option on the server side of a real accepted connection, on the test's own
(stdlib asyncio) loop: uvloop would set the option itself and hide a regression here.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamod.daemon.frontend.http.server import (
    HttpServer,
    NoDelayHttpToolsProtocol,
    accepted_sockets_inherit_nodelay,
    bind_socket,
    http_protocol_for,
)


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _accepted_nodelay(server: HttpServer) -> int:
    """Opens a keep-alive connection, completes one request, and reads TCP_NODELAY on the server's side."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 200")
        connections = server._server.server_state.connections
        assert len(connections) == 1
        (protocol,) = connections
        sock = protocol.transport.get_extra_info("socket")
        return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    finally:
        writer.close()


def _listener_without_nodelay() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    return sock


def test_bind_socket_turns_nagle_off_on_the_listener() -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inheritance is relied on only on Linux")
def test_on_linux_the_plain_protocol_is_used_because_accepted_sockets_inherit() -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert accepted_sockets_inherit_nodelay(sock)
        assert http_protocol_for(sock) is HttpToolsProtocol
    finally:
        sock.close()


def test_a_listener_without_nodelay_gets_the_per_connection_protocol() -> None:
    sock = _listener_without_nodelay()
    try:
        assert not accepted_sockets_inherit_nodelay(sock)
        assert http_protocol_for(sock) is NoDelayHttpToolsProtocol
    finally:
        sock.close()


@pytest.mark.parametrize("listener", ["bind_socket", "plain"])
async def test_accepted_connections_have_nagle_off(listener: str) -> None:
    assert "uvloop" not in type(asyncio.get_running_loop()).__module__
    sock = bind_socket("127.0.0.1", 0) if listener == "bind_socket" else _listener_without_nodelay()
    server = HttpServer(_ok, sock, graceful_s=1.0)
    await server.start()
    try:
        assert await _accepted_nodelay(server) != 0
    finally:
        await server.stop()
