"""The NATS event plane against a real nats-server (JetStream enabled), publisher in a child process
where the point is delivery between processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from dynamod.shared.errors import EventPlaneError
from dynamod.shared.events.nats_plane import NatsEventPlane
from dynamod.shared.events.plane import TOPIC_KV_EVENTS, TOPIC_KV_METRICS, EventMessage, EventPlane
from tests.fixtures.servers import NatsServer, free_port, wait_for
from tests.integration.events.helpers_events.child import PublisherProcess

TOPIC = TOPIC_KV_EVENTS


async def next_payload(sub: AsyncIterator[EventMessage], timeout: float = 10.0) -> bytes:
    msg = await asyncio.wait_for(anext(sub), timeout)
    return msg.payload


async def collect(sub: AsyncIterator[EventMessage], n: int, timeout: float = 10.0) -> list[bytes]:
    return [await next_payload(sub, timeout) for _ in range(n)]



@pytest.fixture
async def plane(nats_server: NatsServer) -> AsyncIterator[NatsEventPlane]:
    p = NatsEventPlane(nats_server.url, name="test-sub")
    await p.start()
    yield p
    await p.close()


async def test_is_an_event_plane(plane: NatsEventPlane) -> None:
    assert isinstance(plane, EventPlane)
    assert plane.name == "nats"


async def test_unreachable_server_fails_fast_naming_the_url() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    p = NatsEventPlane(url, connect_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(EventPlaneError) as info:
        await p.start()
    assert time.monotonic() - t0 < 3.0
    assert url in str(info.value)


async def test_delivery_from_another_process_with_scoping(
    nats_server: NatsServer, plane: NatsEventPlane
) -> None:
    exact = await plane.subscribe("ns1", "worker", TOPIC)
    every = await plane.subscribe("ns1", "*", TOPIC)
    child = PublisherProcess("--plane", "nats", "--url", nats_server.url)
    try:
        await child.ready()
        # Out of scope for both subscribers: another namespace, another topic.
        await child.call(cmd="pub", ns="ns2", component="worker", topic=TOPIC, count=3, prefix="other-ns")
        await child.call(
            cmd="pub", ns="ns1", component="worker", topic=TOPIC_KV_METRICS, count=3, prefix="metrics"
        )
        # Another component: only the "*" subscriber.
        await child.call(cmd="pub", ns="ns1", component="prefill", topic=TOPIC, count=2, prefix="prefill")
        await child.call(cmd="pub", ns="ns1", component="worker", topic=TOPIC, count=5, prefix="w")

        assert await collect(exact, 5) == [f"w-{i}".encode() for i in range(5)]
        got = await collect(every, 7)
        assert got == [b"prefill-0", b"prefill-1"] + [f"w-{i}".encode() for i in range(5)]
        assert exact.dropped == 0 and every.dropped == 0
    finally:
        assert child.stop() == 0


async def test_old_subscriber_receives_after_server_restart(
    nats_server: NatsServer, plane: NatsEventPlane
) -> None:
    publisher_plane = NatsEventPlane(nats_server.url, name="test-pub")
    await publisher_plane.start()
    try:
        sub = await plane.subscribe("ns", "worker", TOPIC)
        pub = await publisher_plane.publisher("ns", "worker", TOPIC)
        await pub.publish(TOPIC, b"before")
        assert await next_payload(sub) == b"before"

        await asyncio.to_thread(nats_server.restart)
        await wait_for(
            lambda: plane.reconnects >= 1 and publisher_plane.reconnects >= 1, 15, "both reconnected"
        )

        for i in range(3):
            await pub.publish(TOPIC, f"after-{i}".encode())
        assert await collect(sub, 3) == [b"after-0", b"after-1", b"after-2"]
        assert plane.disconnects == 1 and plane.connected
    finally:
        await publisher_plane.close()


async def test_publish_while_server_down_is_bounded_and_sent_after_reconnect(nats_server: NatsServer) -> None:
    p = NatsEventPlane(nats_server.url, publish_buffer=5)
    await p.start()
    try:
        # Subscriber and publisher share one connection: after the reconnect the client replays
        # the subscription before the publisher's buffer is sent, so the survivors must arrive.
        sub = await p.subscribe("ns", "worker", TOPIC)
        pub = await p.publisher("ns", "worker", TOPIC)
        await asyncio.to_thread(nats_server.stop)
        await wait_for(lambda: not p.connected, 10, "the client to notice the server is gone")

        t0 = time.monotonic()
        for i in range(8):
            await pub.publish(TOPIC, f"m{i}".encode())
        assert time.monotonic() - t0 < 0.5, "publish must not wait for the server"
        assert pub.pending == 5 and pub.dropped == 3  # the oldest three gave way

        await asyncio.to_thread(nats_server.start)
        assert await collect(sub, 5, timeout=15) == [f"m{i}".encode() for i in range(3, 8)]
        assert pub.pending == 0 and p.stats()["publish_dropped"] == 3
    finally:
        await p.close()


async def test_slow_subscriber_drops_oldest_and_counts(nats_server: NatsServer) -> None:
    p = NatsEventPlane(nats_server.url, subscriber_queue=10)
    await p.start()
    try:
        sub = await p.subscribe("ns", "worker", TOPIC)
        pub = await p.publisher("ns", "worker", TOPIC)
        for i in range(50):
            await pub.publish(TOPIC, f"m{i}".encode())
        await wait_for(lambda: sub.received == 50, 10, "all 50 messages to reach the subscriber")
        assert sub.dropped == 40
        assert await collect(sub, 10) == [f"m{i}".encode() for i in range(40, 50)]
    finally:
        await p.close()


async def test_durable_consumer_gets_what_was_published_while_away(nats_server: NatsServer) -> None:
    pub_plane = NatsEventPlane(nats_server.url, name="test-pub")
    await pub_plane.start()
    try:
        pub = await pub_plane.publisher("ns", "worker", TOPIC, durable=True)

        first = NatsEventPlane(nats_server.url, name="router-1")
        await first.start()
        sub = await first.subscribe("ns", "*", TOPIC, durable_name="router")
        await pub.publish(TOPIC, b"seen-live")
        assert await next_payload(sub) == b"seen-live"
        await first.close()  # the subscriber process goes away; its durable consumer stays

        for i in range(5):
            await pub.publish(TOPIC, f"missed-{i}".encode())
        assert await pub.flush(), "durable publishes must be acknowledged by the stream"

        second = NatsEventPlane(nats_server.url, name="router-2")
        await second.start()
        try:
            sub2 = await second.subscribe("ns", "*", TOPIC, durable_name="router")
            assert await collect(sub2, 5) == [f"missed-{i}".encode() for i in range(5)]
            await pub.publish(TOPIC, b"live-again")
            assert await next_payload(sub2) == b"live-again"
        finally:
            await second.close()
    finally:
        await pub_plane.close()


async def test_durable_publish_survives_server_restart(
    nats_server: NatsServer, plane: NatsEventPlane
) -> None:
    sub = await plane.subscribe("ns", "worker", TOPIC, durable_name="kv-router")
    pub = await plane.publisher("ns", "worker", TOPIC, durable=True)
    await asyncio.to_thread(nats_server.stop)
    await wait_for(lambda: not plane.connected, 10, "the client to notice the server is gone")
    for i in range(3):
        await pub.publish(TOPIC, f"while-down-{i}".encode())
    await asyncio.to_thread(nats_server.start)  # same data dir: the stream and consumer persist
    assert await collect(sub, 3, timeout=20) == [f"while-down-{i}".encode() for i in range(3)]


async def test_durable_without_jetstream_says_how_to_fix_it() -> None:
    server = NatsServer(jetstream=False).start()
    p = NatsEventPlane(server.url)
    try:
        await p.start()
        with pytest.raises(EventPlaneError, match="-js"):
            await p.publisher("ns", "worker", TOPIC, durable=True)
        with pytest.raises(EventPlaneError, match="-js"):
            await p.subscribe("ns", "worker", TOPIC, durable_name="router")
    finally:
        await p.close()
        server.cleanup()
