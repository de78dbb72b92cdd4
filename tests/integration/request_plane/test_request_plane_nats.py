"""The NATS request plane between processes, against a real nats-server: concurrency, a vanished
client, credit pacing, a dying server, a NATS restart, and the factory's two-transport client.

The scenarios TCP and NATS share (ordered complete streams, handler errors, cancellation,
deadlines, the client's frame limit, graceful stop) run over both in test_request_plane.py."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from dynamod.shared.errors import (
    ConfigError,
    DeadlineExceededError,
    TransportError,
)
from dynamod.shared.transport.factory import make_client, make_server
from dynamod.shared.transport.nats_client import NatsRequestClient
from dynamod.shared.transport.nats_wire import NatsRequest, encoder, endpoint_subject, response_decoder
from dynamod.shared.transport.plane import RequestContext, ServerAddress
from tests.fixtures.servers import NatsServer
from tests.integration.request_plane.helpers_transport import ServerProcess, collect, stats, wait_for

HEARTBEAT_S = 0.2


@pytest.fixture(scope="module")
def server_proc(nats: NatsServer) -> Iterator[ServerProcess]:
    with ServerProcess("nats", nats_url=nats.url).start() as proc:
        yield proc


@pytest.fixture
async def client(nats: NatsServer) -> AsyncIterator[NatsRequestClient]:
    c = NatsRequestClient(nats.url, heartbeat_s=HEARTBEAT_S)
    try:
        yield c
    finally:
        await c.close()


def test_endpoint_subjects_keep_names_as_single_tokens():
    assert endpoint_subject("B", "dynamo/backend/generate/1a2b") == "B.rq.dynamo.backend.generate.1a2b"
    assert endpoint_subject("B", "ns.x/comp*/gen>/") == "B.rq.ns_x.comp_.gen_._"


async def test_many_concurrent_streams(client, address):
    results = await asyncio.gather(
        *(collect(client.stream(address, "test/count", {"n": 20 + k})) for k in range(100))
    )
    for k, items in enumerate(results):
        assert items == list(range(20 + k))


async def test_a_vanished_client_frees_its_handlers(client, address, nats):
    """A client that stops answering heartbeats (its process died) gets its handler cancelled."""
    import nats as nats_py

    rid = f"nats-vanish-{os.getpid()}-{time.monotonic_ns()}"
    raw = await nats_py.connect(nats.url)
    try:
        inbox = raw.new_inbox()
        sub = await raw.subscribe(inbox)
        request = NatsRequest("test/hang", request_id=rid, credit=8, heartbeat_s=0.1)
        await raw.publish(
            endpoint_subject(address.address, "test/hang"), encoder.encode(request), reply=inbox
        )
        first = await sub.next_msg(timeout=10)
        assert response_decoder.decode(first.data).data == "started"
        await sub.unsubscribe()  # from here on nobody reads or answers: the client is gone
    finally:
        await raw.close()

    async def handler_finished():
        s = await stats(client, address)
        return rid in s["finished"] and s["inflight"] == 0

    await wait_for(handler_finished, 10, what="the handler's finally after the client vanished")


async def test_slow_reader_is_paced_by_credit(client, address):
    rid = f"nats-slow-{os.getpid()}-{time.monotonic_ns()}"
    slow = client.stream(address, "test/produce", None, request_id=rid)
    assert await slow.__anext__() == 0
    assert await collect(client.stream(address, "test/count", {"n": 2_000})) == list(range(2_000))
    s = await stats(client, address)
    assert s["progress"][rid] + 1 <= client.window_frames + 2
    assert slow.buffered <= client.window_frames
    more = [await slow.__anext__() for _ in range(2 * client.window_frames)]
    assert more == list(range(1, 1 + 2 * client.window_frames))
    await slow.aclose()


async def test_server_killed_mid_stream_raises_transport_error(client, nats):
    proc = ServerProcess("nats", nats_url=nats.url).start()
    try:
        assert proc.address is not None
        address = proc.address
        stream = client.stream(address, "test/paced", {"n": 1000, "interval_s": 0.01})
        assert [await stream.__anext__() for _ in range(5)] == list(range(5))
        proc.kill()
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            async with asyncio.timeout(10):
                await collect(stream)
        assert time.monotonic() - t0 < 10 * HEARTBEAT_S + 2
        # Nobody serves that subject any more: a new request fails fast (no responders).
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            await collect(client.stream(address, "test/echo", 1))
        assert time.monotonic() - t0 < 2
    finally:
        proc.cleanup()


async def test_new_requests_succeed_after_nats_restarts(nats_server):
    proc = ServerProcess("nats", nats_url=nats_server.url).start()
    c = NatsRequestClient(nats_server.url, heartbeat_s=HEARTBEAT_S)
    try:
        assert proc.address is not None
        address = proc.address
        assert await collect(c.stream(address, "test/count", {"n": 100})) == list(range(100))
        await asyncio.to_thread(nats_server.restart)

        async def request_ok():
            try:
                return await collect(c.stream(address, "test/count", {"n": 100}, timeout_s=1)) == list(
                    range(100)
                )
            except (TransportError, DeadlineExceededError):
                return False

        await wait_for(request_ok, 20, interval=0.1, what="a request after the NATS restart")
        assert await collect(c.stream(address, "test/count", {"n": 1000})) == list(range(1000))
    finally:
        await c.close()
        proc.cleanup()


async def test_one_client_talks_to_tcp_and_nats_instances(nats):
    async def hello(body: object, ctx: RequestContext):
        yield f"hello {body} via {ctx.endpoint}"

    tcp = make_server("tcp")
    via_nats = make_server("nats", nats_url=nats.url)
    for server in (tcp, via_nats):
        server.register("ns/comp/hello/1", hello)
    tcp_address = await tcp.start()
    nats_address = await via_nats.start()
    client = make_client(nats_url=nats.url)
    try:
        assert tcp_address.transport == "tcp" and nats_address.transport == "nats"
        assert await collect(client.stream(tcp_address, "ns/comp/hello/1", "a")) == [
            "hello a via ns/comp/hello/1"
        ]
        assert await collect(client.stream(nats_address, "ns/comp/hello/1", "b")) == [
            "hello b via ns/comp/hello/1"
        ]
        with pytest.raises(TransportError, match="unknown request-plane transport"):
            await collect(client.stream(ServerAddress("carrier-pigeon", "x"), "ns/comp/hello/1", "c"))
    finally:
        await client.close()
        await tcp.stop(1)
        await via_nats.stop(1)


def test_unknown_request_plane_name_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown request plane"):
        make_server("udp")
