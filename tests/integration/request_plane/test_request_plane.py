"""The request plane between processes.

The scenarios both transports share (complete ordered streams, handler errors, cancellation,
deadlines, the client's frame limit, graceful stop) run over TCP and NATS alike (the ``plane``
fixture); the rest of this file is TCP-only: multiplexing on one connection, bad frames, a dying
server, slow readers and in-process stop semantics. NATS-only scenarios are in
test_request_plane_nats.py."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dynamod.shared.errors import (
    DeadlineExceededError,
    FrameTooLargeError,
    InvalidRequestError,
    NotFoundError,
    RemoteError,
    TransportError,
    UnavailableError,
)
from dynamod.shared.transport.framing import (
    DEFAULT_WINDOW_FRAMES,
    HEADER,
    ClientFrame,
    FrameReader,
    ServerFrame,
    encode_frame,
)
from dynamod.shared.transport.nats_client import NatsRequestClient
from dynamod.shared.transport.plane import RequestContext, ServerAddress
from dynamod.shared.transport.tcp_client import TcpRequestClient, parse_host_port
from dynamod.shared.transport.tcp_server import TcpRequestServer
from tests.fixtures.request_plane import tcp_plane
from tests.fixtures.servers import free_port
from tests.integration.request_plane.helpers_transport import ServerProcess, collect, stats, wait_for

SERVER_MAX_FRAME = 1024 * 1024
NATS_HEARTBEAT_S = 0.2


@dataclass
class Plane:
    """One transport under test: how to start a server process and make a client for it."""

    transport: str
    server: ServerProcess
    nats_url: str | None
    # What a request to a stopping server raises: TCP may also see the connection close first.
    late_request_errors: tuple[type[Exception], ...]

    @property
    def address(self) -> ServerAddress:
        assert self.server.address is not None
        return self.server.address

    def make_client(self, **kwargs: Any) -> Any:
        if self.transport == "tcp":
            return TcpRequestClient(**kwargs)
        return NatsRequestClient(self.nats_url, **kwargs)

    def server_process(self, **kwargs: Any) -> ServerProcess:
        if self.nats_url is not None:
            kwargs["nats_url"] = self.nats_url
        return ServerProcess(self.transport, **kwargs)


@pytest.fixture(scope="module", params=["tcp", "nats"])
def plane(request: pytest.FixtureRequest) -> Iterator[Plane]:
    if request.param == "tcp":
        yield Plane("tcp", request.getfixturevalue("server_proc"), None, (UnavailableError, TransportError))
        return
    nats_url = request.getfixturevalue("nats").url
    with ServerProcess("nats", nats_url=nats_url).start() as proc:
        yield Plane("nats", proc, nats_url, (UnavailableError,))


@pytest.fixture
async def plane_client(plane: Plane) -> AsyncIterator[Any]:
    kwargs = {"heartbeat_s": NATS_HEARTBEAT_S} if plane.transport == "nats" else {}
    c = plane.make_client(**kwargs)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture(scope="module")
def server_proc() -> Iterator[ServerProcess]:
    with ServerProcess("tcp", max_frame_bytes=SERVER_MAX_FRAME).start() as proc:
        yield proc


@pytest.fixture
async def client() -> AsyncIterator[TcpRequestClient]:
    c = TcpRequestClient()
    try:
        yield c
    finally:
        await c.close()


def _rid(plane: Plane, what: str) -> str:
    return f"{plane.transport}-{what}-{os.getpid()}-{time.monotonic_ns()}"


def _handler_finished(client: Any, address: ServerAddress, rid: str) -> Callable[[], Any]:
    """A ``wait_for`` condition: the server ran the handler's finally for ``rid`` and holds no
    request; its value is the server's stats."""

    async def check() -> dict[str, Any] | None:
        s = await stats(client, address)
        return s if rid in s["finished"] and s["inflight"] == 0 else None

    return check


# -- both transports --------------------------------------------------------------------------


async def test_ten_thousand_responses_arrive_complete_and_in_order(plane, plane_client):
    items = await collect(plane_client.stream(plane.address, "test/count", {"n": 10_000}))
    assert items == list(range(10_000))


async def test_handler_errors_come_back_as_their_class(plane, plane_client):
    address = plane.address
    with pytest.raises(InvalidRequestError, match="rejected"):
        await collect(plane_client.stream(address, "test/fail", "bad"))
    with pytest.raises(NotFoundError, match="no handler"):
        await collect(plane_client.stream(address, "test/nope", None))
    # The client survives handler errors.
    assert await collect(plane_client.stream(address, "test/echo", {"ok": True})) == [{"ok": True}]


async def test_client_aclose_reaches_the_handler(plane, plane_client):
    rid = _rid(plane, "close")
    stream = plane_client.stream(plane.address, "test/hang", None, request_id=rid)
    assert await stream.__anext__() == "started"
    await stream.aclose()

    s = await wait_for(_handler_finished(plane_client, plane.address, rid), 10,
                       what="the handler's finally after cancel")
    assert s["finished"][rid] in ("cancelled", "closed")


async def test_breaking_out_of_the_loop_reaches_the_handler(plane, plane_client):
    rid = _rid(plane, "break")
    async for item in plane_client.stream(plane.address, "test/hang", None, request_id=rid):
        assert item == "started"
        break  # no aclose(): the dropped stream cancels itself

    await wait_for(_handler_finished(plane_client, plane.address, rid), 10, what="the handler's finally after break")


async def test_deadline_exceeded_raises_and_cancels_the_handler(plane, plane_client):
    rid = _rid(plane, "deadline")
    t0 = time.monotonic()
    items = []
    with pytest.raises(DeadlineExceededError):
        async for item in plane_client.stream(plane.address, "test/hang", None, timeout_s=0.3, request_id=rid):
            items.append(item)
    elapsed = time.monotonic() - t0
    assert items == ["started"]
    assert 0.3 <= elapsed < 5

    await wait_for(_handler_finished(plane_client, plane.address, rid), 10,
                   what="the handler's finally after the deadline")


async def test_client_refuses_an_oversize_body(plane):
    small = plane.make_client(max_frame_bytes=1024)
    try:
        with pytest.raises(FrameTooLargeError):
            await collect(small.stream(plane.address, "test/echo", "x" * 2048))
        # Nothing half-written: the client still works for a body that fits.
        assert await collect(small.stream(plane.address, "test/echo", "x" * 100)) == ["x" * 100]
    finally:
        await small.close()


async def test_graceful_stop_lets_the_inflight_stream_finish(plane, plane_client):
    proc = plane.server_process(grace_s=20).start()
    try:
        assert proc.address is not None
        address = proc.address
        stream = plane_client.stream(address, "test/paced", {"n": 20, "interval_s": 0.04})
        assert await stream.__anext__() == 0
        proc.terminate()
        assert proc.read_line(10) == {"event": "stopping"}
        with pytest.raises(plane.late_request_errors):
            await collect(plane_client.stream(address, "test/echo", "late"))
        rest = await collect(stream)
        assert rest == list(range(1, 20))
        assert proc.read_line(20) == {"event": "stopped"}
        assert proc.wait(10) == 0
    finally:
        proc.cleanup()


# -- TCP: streams -----------------------------------------------------------------------------


async def test_many_concurrent_streams_share_one_connection(client, address):
    async def one(k: int) -> list[object]:
        return await collect(client.stream(address, "test/count", {"n": 50 + k}))

    results = await asyncio.gather(*(one(k) for k in range(200)))
    for k, items in enumerate(results):
        assert items == list(range(50 + k))
    assert client.connection_count() == 1


async def test_none_and_nested_bodies_round_trip(client, address):
    body = {"tokens": list(range(300)), "nested": {"a": [None, 1.5, "x"]}, "none": None}
    assert await collect(client.stream(address, "test/echo", body)) == [body]
    assert await collect(client.stream(address, "test/echo", None)) == [None]


# -- TCP: cancellation -----------------------------------------------------------------------


async def test_cancelling_the_reading_task_reaches_the_handler(client, address):
    rid = f"task-{os.getpid()}-{time.monotonic_ns()}"
    first = asyncio.Event()

    async def reader() -> None:
        async for _ in client.stream(address, "test/hang", None, request_id=rid):
            first.set()

    task = asyncio.create_task(reader())
    await asyncio.wait_for(first.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    await wait_for(_handler_finished(client, address, rid), 10, what="the handler's finally after task cancel")


async def test_a_vanished_client_frees_its_handlers(client, address):
    rid = f"vanish-{os.getpid()}-{time.monotonic_ns()}"
    host, port = parse_host_port(address.address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        encode_frame(ClientFrame(1, endpoint="test/hang", request_id=rid, credit=8), SERVER_MAX_FRAME)
    )
    frames, _ = await _read_frames(reader, 1)
    assert frames[0].data == "started"
    writer.transport.abort()  # the client process "dies": no cancel frame, just a reset

    await wait_for(_handler_finished(client, address, rid), 10, what="the handler's finally after the connection dropped")


# -- bad frames -------------------------------------------------------------------------------


async def _read_frames(
    reader: asyncio.StreamReader, want: int, timeout: float = 10
) -> tuple[list[object], bool]:
    """Reads until ``want`` frames arrived or the server closed; returns (frames, closed)."""
    parser: FrameReader[ServerFrame] = FrameReader(ServerFrame, SERVER_MAX_FRAME)
    frames: list[object] = []
    async with asyncio.timeout(timeout):
        while len(frames) < want:
            chunk = await reader.read(65536)
            if not chunk:
                return frames, True
            frames += parser.feed(chunk)
    return frames, False


async def test_malformed_frames_get_errors_and_the_server_keeps_serving(client, address):
    host, port = parse_host_port(address.address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        garbage = b"\xc1\xc1 not msgpack"
        wrong_types = encode_frame(ClientFrame(7, endpoint="test/echo"), SERVER_MAX_FRAME)[HEADER.size :]
        wrong_types = wrong_types.replace(b"\xa8endpoint\xa9test/echo", b"\xa8endpoint\x05")  # endpoint: 5
        writer.write(HEADER.pack(len(garbage)) + garbage + HEADER.pack(len(wrong_types)) + wrong_types)
        frames, closed = await _read_frames(reader, 2)
        assert not closed
        assert [(f.stream_id, f.error["code"]) for f in frames] == [
            (0, "protocol_error"),
            (7, "protocol_error"),
        ]
        # The same connection still serves a well-formed request.
        writer.write(
            encode_frame(ClientFrame(9, endpoint="test/echo", body="hi", credit=4), SERVER_MAX_FRAME)
        )
        frames, _ = await _read_frames(reader, 2)
        assert [(f.stream_id, f.data, f.end) for f in frames][0][:2] == (9, "hi")
        assert frames[1].end is True
    finally:
        writer.close()
    assert await collect(client.stream(address, "test/count", {"n": 3})) == [0, 1, 2]


async def test_oversize_frame_gets_an_error_and_only_that_connection_closes(client, address):
    assert await collect(client.stream(address, "test/echo", "before")) == ["before"]
    host, port = parse_host_port(address.address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(HEADER.pack(SERVER_MAX_FRAME + 1) + b"\x00" * 1024)
        frames, closed = await _read_frames(reader, 2)
        assert len(frames) == 1 and frames[0].stream_id == 0
        assert frames[0].error["code"] == "frame_too_large"
        assert closed
    finally:
        writer.close()
    # Another client's connection was not disturbed.
    assert client.connection_count() == 1
    assert await collect(client.stream(address, "test/echo", "after")) == ["after"]


async def test_garbage_bytes_connection_does_not_hurt_the_server(client, address):
    host, port = parse_host_port(address.address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(os.urandom(64 * 1024))
    try:
        async with asyncio.timeout(10):
            while await reader.read(65536):
                pass
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        writer.close()
    assert await collect(client.stream(address, "test/count", {"n": 5})) == list(range(5))


async def test_server_reports_an_oversize_response(client, address):
    with pytest.raises(FrameTooLargeError):
        await collect(client.stream(address, "test/count", {"n": 1, "pad": SERVER_MAX_FRAME + 10}))


# -- flow control -----------------------------------------------------------------------------


async def test_slow_reader_stays_bounded_while_another_stream_completes(client, address):
    rid = f"slow-{os.getpid()}-{time.monotonic_ns()}"
    slow = client.stream(address, "test/produce", None, request_id=rid)
    assert await slow.__anext__() == 0
    # The producer is endless; it can only get ahead of its reader by the window.
    async with asyncio.timeout(30):  # without flow control the producer floods the connection
        fast = await collect(client.stream(address, "test/count", {"n": 5_000, "pad": 64}))
    assert [item[0] for item in fast] == list(range(5_000))
    assert client.connection_count() == 1

    s = await stats(client, address)
    sent = s["progress"][rid] + 1
    assert DEFAULT_WINDOW_FRAMES <= sent <= 1 + DEFAULT_WINDOW_FRAMES + 1
    assert slow.buffered <= DEFAULT_WINDOW_FRAMES
    assert s["server"]["write_buffer_bytes"] < 256 * 1024
    assert s["server"]["streams_waiting_for_credit"] >= 1

    # Reading again resumes the producer, in order.
    more = [await slow.__anext__() for _ in range(3 * DEFAULT_WINDOW_FRAMES)]
    assert more == list(range(1, 1 + 3 * DEFAULT_WINDOW_FRAMES))
    await slow.aclose()

    await wait_for(_handler_finished(client, address, rid), 10, what="the producer's finally")


# -- server failure and restart ---------------------------------------------------------------


async def test_server_killed_mid_stream_raises_transport_error_then_reconnects(client):
    port = free_port()
    proc = ServerProcess("tcp", port=port).start()
    try:
        assert proc.address is not None
        address = proc.address
        stream = client.stream(address, "test/produce", None)
        assert [await stream.__anext__() for _ in range(10)] == list(range(10))
        proc.kill()
        with pytest.raises(TransportError):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            await collect(client.stream(address, "test/echo", 1))
        assert time.monotonic() - t0 < 2.0  # refused, not hanging

        proc.cleanup()
        proc = ServerProcess("tcp", port=port).start()
        assert proc.address == address
        assert await collect(client.stream(address, "test/echo", "back")) == ["back"]
    finally:
        proc.cleanup()


async def test_connection_refused_is_quick(client):
    address = ServerAddress("tcp", f"127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="cannot connect"):
        await collect(client.stream(address, "test/echo", 1))
    assert time.monotonic() - t0 < 2.0


# -- in-process: stop semantics that need a gate the test controls ----------------------------


async def test_stop_refuses_new_streams_and_cancels_after_grace():
    gate = asyncio.Event()
    outcomes: list[str] = []

    async def gated(body: object, ctx: RequestContext):
        try:
            yield "first"
            await gate.wait()
            yield "second"
            outcomes.append("finished")
        except asyncio.CancelledError:
            outcomes.append("cancelled")
            raise

    async with tcp_plane({"gated": gated}) as (server, address, client):
        try:
            finishing = client.stream(address, "gated", None)
            abandoned = client.stream(address, "gated", None)
            assert await finishing.__anext__() == "first"
            assert await abandoned.__anext__() == "first"
            assert server.inflight == 2

            stop = asyncio.create_task(server.stop(grace_s=0.5))
            await wait_for(_async(lambda: server.stopping), 5, what="stopping")
            with pytest.raises(UnavailableError):
                await collect(client.stream(address, "gated", None))
            # The grace period runs out while both wait at the gate: both are cancelled.
            await asyncio.wait_for(stop, 10)
            assert outcomes == ["cancelled", "cancelled"]
            assert server.inflight == 0
            with pytest.raises((UnavailableError, TransportError)):
                await collect(finishing)
        finally:
            gate.set()


async def test_stop_waits_for_streams_within_grace():
    gate = asyncio.Event()

    async def gated(body: object, ctx: RequestContext):
        yield "first"
        await gate.wait()
        yield "second"

    server = TcpRequestServer()
    server.register("gated", gated)
    address = await server.start()
    client = TcpRequestClient()
    try:
        stream = client.stream(address, "gated", None)
        assert await stream.__anext__() == "first"
        stop = asyncio.create_task(server.stop(grace_s=30))
        await wait_for(_async(lambda: server.stopping), 5, what="stopping")
        assert not stop.done()
        gate.set()
        assert await collect(stream) == ["second"]
        await asyncio.wait_for(stop, 10)
        assert server.inflight == 0
    finally:
        await client.close()


def _async(fn):
    async def call():
        return fn()

    return call


async def test_handler_failures_never_leave_the_client_waiting():
    async def cancels_itself(body: object, ctx: RequestContext):
        yield "one"
        raise asyncio.CancelledError  # e.g. an engine task it awaited was cancelled

    async def downstream_lost(body: object, ctx: RequestContext):
        yield "one"
        raise TransportError("connection to the prefill worker lost")

    handlers = {"cancels_itself": cancels_itself, "downstream_lost": downstream_lost}
    async with tcp_plane(handlers) as (server, address, client):
        for endpoint, remote_code in (
            ("cancels_itself", "internal_error"),
            ("downstream_lost", "transport_error"),
        ):
            items: list[object] = []
            with pytest.raises(RemoteError) as info:
                async with asyncio.timeout(10):
                    async for item in client.stream(address, endpoint, None):
                        items.append(item)
            assert items == ["one"]
            assert info.value.remote_code == remote_code
        assert server.inflight == 0
