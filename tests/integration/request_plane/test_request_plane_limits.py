"""The TCP request-plane server's caps on real sockets: connections held at once, and idle reads."""

from __future__ import annotations

import asyncio
import time

import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.errors import ConfigError
from dynamod.shared.transport.framing import FrameReader, ServerFrame
from dynamod.shared.transport.plane import DEFAULT_MAX_FRAME_BYTES, RequestContext
from dynamod.shared.transport.tcp_client import TcpRequestClient
from dynamod.shared.transport.tcp_server import ConnectionLimits, TcpRequestServer

pytestmark = pytest.mark.timeout(60)


async def _echo(body: object, ctx: RequestContext):
    yield body


async def _read_until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
        if not chunk:
            return data
        data += chunk


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


async def test_connections_over_the_cap_are_told_overloaded_and_closed() -> None:
    server = TcpRequestServer(limits=ConnectionLimits(max_connections=2, idle_timeout_s=0))
    server.register("echo", _echo)
    address = await server.start()
    host, port = _host_port(address.address)
    held = [await asyncio.open_connection(host, port) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while server.stats()["connections"] < 2:
            assert time.monotonic() < deadline, "the two connections were not accepted"
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(host, port)
        data = await _read_until_closed(reader, 5)
        writer.close()
        frames = list(FrameReader(ServerFrame, DEFAULT_MAX_FRAME_BYTES).feed(data))
        assert frames and frames[0].stream_id == 0 and frames[0].error["code"] == "overloaded"
        assert server.refused_over_limit == 1 and server.stats()["connections"] == 2
        # Room again once one goes: a real client is served.
        held.pop()[1].close()
        client = TcpRequestClient()
        try:
            deadline = time.monotonic() + 5
            while server.stats()["connections"] > 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert [x async for x in client.stream(address, "echo", "hi")] == ["hi"]
        finally:
            await client.close()
    finally:
        for _, w in held:
            w.close()
        await server.stop(0)


async def test_idle_and_stalled_connections_are_closed_but_busy_ones_are_not() -> None:
    gate = asyncio.Event()

    async def slow(body: object, ctx: RequestContext):
        await gate.wait()
        yield "done"

    server = TcpRequestServer(limits=ConnectionLimits(idle_timeout_s=0.3))
    server.register("echo", _echo)
    server.register("slow", slow)
    address = await server.start()
    host, port = _host_port(address.address)
    client = TcpRequestClient()
    try:
        silent_r, silent_w = await asyncio.open_connection(host, port)
        stalled_r, stalled_w = await asyncio.open_connection(host, port)
        stalled_w.write(b"\x00\x00")  # two bytes of a frame header, then nothing
        assert await _read_until_closed(silent_r, 5) == b""
        assert await _read_until_closed(stalled_r, 5) == b""
        silent_w.close()
        stalled_w.close()
        # A stream open for longer than the idle timeout keeps its connection.
        stream = client.stream(address, "slow", None)
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # let it be sent
        deadline = time.monotonic() + 1.0  # well past the 0.3 s idle timeout
        while time.monotonic() < deadline:
            assert not pending.done()
            await asyncio.sleep(0.05)
        gate.set()
        assert await asyncio.wait_for(pending, 5) == "done"
        # Once idle, the client's connection is closed too, and its next request dials again.
        deadline = time.monotonic() + 5
        while server.stats()["connections"]:
            assert time.monotonic() < deadline, "the idle client connection was not closed"
            await asyncio.sleep(0.02)
        # The client learns of the close when it reads the end of the socket, a moment after the
        # server counted it gone; a request sent in between fails as TransportError (which the
        # frontend migrates), so the next request here waits until the client knows.
        while client.connection_count():
            assert time.monotonic() < deadline, "the client did not see its idle connection closed"
            await asyncio.sleep(0.02)
        assert [x async for x in client.stream(address, "echo", "again")] == ["again"]
    finally:
        gate.set()
        await client.close()
        await server.stop(0)


def test_limits_are_validated_and_come_from_settings() -> None:
    with pytest.raises(ConfigError):
        ConnectionLimits(max_connections=0).validate()
    with pytest.raises(ConfigError):
        ConnectionLimits(idle_timeout_s=-1).validate()
    settings = RuntimeSettings(request_plane_max_connections=7, request_plane_idle_timeout_s=2.5).validate()
    assert settings.request_plane_limits == ConnectionLimits(7, 2.5)
