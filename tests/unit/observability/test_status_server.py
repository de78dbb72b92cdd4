"""The status server's stop and its busy port (repairs found in review: each test fails without
its repair). That a busy port also releases the half-built runtime: tests/unit/runtime/test_distributed.py."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry

from dynamod.shared.errors import ConfigError
from dynamod.shared.observability.status_server import StatusServer


async def test_status_server_stop_closes_a_scrapers_keepalive_connection() -> None:
    """Python 3.12+ wait_closed() waits for open connections: a Prometheus scraper's keep-alive
    connection would hold shutdown (and the lease revocation after it) for ever."""
    server = StatusServer(CollectorRegistry(), lambda: (True, {}), port=0)
    url = await server.start()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"200 OK" in head and b"keep-alive" in head.lower()
        await asyncio.wait_for(reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])), 5)
        await asyncio.wait_for(server.stop(), 5)
        # The server hung up on the idle scraper instead of waiting up to 30 s for its next request.
        assert await asyncio.wait_for(reader.read(), 2) == b""
    finally:
        writer.close()


async def test_busy_status_port_is_a_config_error_naming_the_flag() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        server = StatusServer(CollectorRegistry(), lambda: (True, {}), port=holder.getsockname()[1])
        with pytest.raises(ConfigError, match="--system-port") as err:
            await server.start()
        assert str(holder.getsockname()[1]) in str(err.value)
    finally:
        holder.close()
