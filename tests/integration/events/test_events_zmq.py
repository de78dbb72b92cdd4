"""The ZMQ event plane on real loopback sockets: publishers found through discovery (the file
backend between two processes; the mem backend where one process is enough).

ZMQ's slow joiner: a SUB socket misses what is published before its connection completes, and
nothing resends it. Tests therefore *prime* a connection (publish probes until one arrives) before
asserting exact delivery, the way the KV router re-reads a worker's state when it first sees it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import zmq
import zmq.asyncio

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.events.plane import TOPIC_KV_EVENTS, TOPIC_KV_METRICS, EventMessage, EventPlane
from dynamod.shared.events.zmq_plane import ZmqEventPlane
from dynamod.shared.events.zmq_subscriber import ZmqEventSubscriber
from dynamod.shared.protocol.keys import EVENT_CHANNELS_ROOT, event_channel_key
from tests.fixtures.servers import wait_for
from tests.integration.events.helpers_events.child import PublisherProcess

TOPIC = TOPIC_KV_EVENTS



async def receive(sub: AsyncIterator[EventMessage], timeout: float) -> EventMessage | None:
    try:
        return await asyncio.wait_for(anext(sub), timeout)
    except TimeoutError:
        return None


async def prime(
    send_probe: Callable[[], Awaitable[None]], sub: ZmqEventSubscriber, publisher_ids: set[int]
) -> None:
    """Sends probes until ``sub`` has received one from every publisher in ``publisher_ids``."""
    seen: set[int] = set()
    deadline = time.monotonic() + 15
    while not publisher_ids <= seen:
        assert time.monotonic() < deadline, f"no probe arrived from {publisher_ids - seen}"
        await send_probe()
        while (msg := await receive(sub, 0.1)) is not None:
            seen.add(msg.publisher_id)


async def collect(sub: ZmqEventSubscriber, n: int, timeout: float = 10.0) -> list[EventMessage]:
    """The next ``n`` messages that are not probes."""
    out: list[EventMessage] = []
    while len(out) < n:
        msg = await asyncio.wait_for(anext(sub), timeout)
        if not msg.payload.startswith(b"probe"):
            out.append(msg)
    return out


@pytest.fixture
async def mem_plane() -> AsyncIterator[tuple[MemStore, ZmqEventPlane]]:
    store = MemStore()
    await store.start()
    lease = await store.create_lease(10.0)
    plane = ZmqEventPlane(store, lease)
    await plane.start()
    yield store, plane
    await plane.close()
    await store.close()


async def test_is_an_event_plane(mem_plane: tuple[MemStore, ZmqEventPlane]) -> None:
    _, plane = mem_plane
    assert isinstance(plane, EventPlane)
    assert plane.name == "zmq"


async def test_delivery_from_another_process_through_file_discovery(tmp_path) -> None:
    root = str(tmp_path / "kv")
    store = FileStore(root, poll_interval_s=0.05)
    await store.start()
    plane = ZmqEventPlane(store, await store.create_lease(10.0))
    await plane.start()
    child = PublisherProcess("--plane", "zmq", "--discovery", "file", "--file-kv", root)
    try:
        exact = await plane.subscribe("ns1", "worker", TOPIC)
        every = await plane.subscribe("ns1", "*", TOPIC)
        info = await child.ready()
        child_id = info["instance_id"]
        scopes = {
            "worker": ("ns1", "worker", TOPIC),
            "prefill": ("ns1", "prefill", TOPIC),
            "other_ns": ("ns2", "worker", TOPIC),
            "other_topic": ("ns1", "worker", TOPIC_KV_METRICS),
        }
        for ns, component, topic in scopes.values():
            opened = await child.call(cmd="open", ns=ns, component=component, topic=topic)
        # The registration is what a subscriber connects to: address on loopback, the child's pid.
        key = event_channel_key("ns1", "worker", TOPIC, child_id)
        entry = json.loads(opened["channels"][key])
        assert entry["address"].startswith("tcp://127.0.0.1:") and entry["pid"] == child.proc.pid

        # Scoping happens at connect time: only matching publishers are connected at all.
        await wait_for(lambda: len(every.publishers) == 2, 10, "the '*' subscriber to find both components")
        await wait_for(lambda: exact.publishers, 10, "the exact subscriber to find its publisher")
        assert list(exact.publishers) == [key]
        assert sorted(every.publishers) == sorted([key, event_channel_key("ns1", "prefill", TOPIC, child_id)])

        async def probe_all() -> None:
            for component in ("worker", "prefill"):
                await child.call(
                    cmd="pub", ns="ns1", component=component, topic=TOPIC, count=1, prefix="probe"
                )

        await prime(probe_all, exact, {child_id})
        await prime(probe_all, every, {child_id})

        await child.call(cmd="pub", ns="ns2", component="worker", topic=TOPIC, count=3, prefix="other-ns")
        await child.call(
            cmd="pub", ns="ns1", component="worker", topic=TOPIC_KV_METRICS, count=3, prefix="metrics"
        )
        await child.call(cmd="pub", ns="ns1", component="prefill", topic=TOPIC, count=2, prefix="prefill")
        await child.call(cmd="pub", ns="ns1", component="worker", topic=TOPIC, count=5, prefix="w")

        got = await collect(exact, 5)
        assert [m.payload for m in got] == [f"w-{i}".encode() for i in range(5)]
        assert {m.publisher_id for m in got} == {child_id}
        assert [m.seq for m in got] == list(range(got[0].seq, got[0].seq + 5))  # consecutive
        assert exact.gaps == 0 and exact.dropped == 0

        both = await collect(every, 7)
        assert sorted(m.payload for m in both) == sorted(
            [b"prefill-0", b"prefill-1"] + [f"w-{i}".encode() for i in range(5)]
        )
        assert every.gaps == 0

        # The publisher closes: its key goes, and the subscriber lets go of the socket.
        await child.call(cmd="close", ns="ns1", component="worker", topic=TOPIC)
        # Each subscription follows discovery through its own watch, so each lets go in its own time.
        await wait_for(lambda: not exact.publishers, 10, "the subscriber to drop the closed publisher")
        remaining = [event_channel_key("ns1", "prefill", TOPIC, child_id)]
        await wait_for(lambda: list(every.publishers) == remaining, 10, "the '*' subscriber to drop it too")
    finally:
        assert child.stop() == 0
        await plane.close()
        await store.close()


async def test_subscriber_follows_publishers_that_come_and_go(
    mem_plane: tuple[MemStore, ZmqEventPlane],
) -> None:
    store, sub_plane = mem_plane
    sub = await sub_plane.subscribe("ns", "worker", TOPIC)
    assert sub.publishers == {}

    # Two worker processes (two leases) start after the subscriber.
    lease_a, lease_b = await store.create_lease(10.0), await store.create_lease(10.0)
    plane_a, plane_b = ZmqEventPlane(store, lease_a), ZmqEventPlane(store, lease_b)
    await plane_a.start()
    await plane_b.start()
    try:
        pub_a = await plane_a.publisher("ns", "worker", TOPIC)
        pub_b = await plane_b.publisher("ns", "worker", TOPIC)
        await wait_for(lambda: len(sub.publishers) == 2, 5, "both publishers to be connected")

        async def probe_both() -> None:
            await pub_a.publish(TOPIC, b"probe")
            await pub_b.publish(TOPIC, b"probe")

        await prime(probe_both, sub, {lease_a.id, lease_b.id})
        await pub_a.publish(TOPIC, b"a-1")
        await pub_b.publish(TOPIC, b"b-1")
        got = {m.payload: m.publisher_id for m in await collect(sub, 2)}
        assert got == {b"a-1": lease_a.id, b"b-1": lease_b.id}

        # Worker A dies: its lease expires, its key disappears, the subscriber disconnects.
        store.expire_lease(lease_a.id)
        await wait_for(lambda: len(sub.publishers) == 1, 5, "the dead publisher to be dropped")
        assert list(sub.publishers) == [pub_b.key]

        # A's socket is still bound (the process is "hung", not gone), but nobody listens to it.
        await pub_a.publish(TOPIC, b"a-after-expiry")
        await pub_b.publish(TOPIC, b"b-2")
        assert [m.payload for m in await collect(sub, 1)] == [b"b-2"]
        assert await receive(sub, 0.2) is None
    finally:
        await plane_a.close()
        await plane_b.close()


async def test_seq_gaps_from_a_foreign_publisher_are_counted(
    mem_plane: tuple[MemStore, ZmqEventPlane],
) -> None:
    """A publisher that is not ours (vLLM's own ZMQ publisher, say) registered in discovery: the
    subscriber reads its [topic, seq, payload] frames and counts the holes in seq."""
    store, plane = mem_plane
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.SNDHWM, 1000)
    raw.bind("tcp://127.0.0.1:0")
    address = raw.getsockopt(zmq.LAST_ENDPOINT).decode()
    publisher_id = 0xABC
    key = event_channel_key("ns", "worker", TOPIC, publisher_id)
    await store.put(key, json.dumps({"address": address, "pid": os.getpid()}).encode())
    try:
        sub = await plane.subscribe("ns", "*", TOPIC)
        seq = 0

        async def send(n: int, payload: bytes = b"x") -> None:
            await raw.send_multipart([TOPIC.encode(), n.to_bytes(8, "big"), payload])

        async def probe() -> None:
            nonlocal seq
            seq += 1
            await send(seq, b"probe")

        # Probe until one arrives, then drain the probes still in flight (up to the last sent).
        last_seen = 0
        deadline = time.monotonic() + 15
        while last_seen == 0 or last_seen != seq:
            assert time.monotonic() < deadline, "no probe arrived"
            if last_seen == 0:
                await probe()
            if (msg := await receive(sub, 0.1)) is not None:
                last_seen = msg.seq
        start = seq
        for n in (start + 1, start + 2, start + 5, start + 6, start + 9):  # holes: 2, then 2
            await send(n, f"m{n}".encode())
        got = await collect(sub, 5)
        assert [m.seq for m in got] == [start + 1, start + 2, start + 5, start + 6, start + 9]
        assert {m.publisher_id for m in got} == {publisher_id}
        assert sub.gaps == 2 and sub.missed == 4

        await raw.send_multipart([TOPIC.encode(), b"short", b"x"])  # not an 8-byte seq
        await send(start + 10, b"after-bad-frame")
        assert [m.payload for m in await collect(sub, 1)] == [b"after-bad-frame"]
        assert sub.malformed == 1 and sub.gaps == 2
    finally:
        raw.close(linger=0)
        ctx.term()


async def test_overflowing_subscriber_sees_exactly_the_holes_in_seq(
    mem_plane: tuple[MemStore, ZmqEventPlane],
) -> None:
    """Small HWMs and a burst that never yields to the loop: ZMQ drops, and the subscriber's
    ``missed`` accounts for every message between the first and the last it received."""
    store, _ = mem_plane
    lease = await store.create_lease(10.0)
    plane = ZmqEventPlane(store, lease, sndhwm=10, rcvhwm=10, subscriber_queue=100_000)
    await plane.start()
    try:
        sub = await plane.subscribe("ns", "worker", TOPIC)
        pub = await plane.publisher("ns", "worker", TOPIC)
        await wait_for(lambda: sub.publishers, 5, "the subscriber to connect")

        async def probe() -> None:
            await pub.publish(TOPIC, b"probe")

        await prime(probe, sub, {lease.id})
        before, missed_before = pub.seq, sub.missed  # every probe up to `before` was received
        payload = b"p" * 2048
        for _ in range(20_000):  # ~40 MB: more than the socket buffers between the two ends hold
            await pub.publish(TOPIC, payload)
        # Read what survived; a marker (re-sent while nothing arrives, since the burst's tail may
        # itself be dropped) says the burst is over.
        seqs: list[int] = []
        deadline = time.monotonic() + 15
        while not seqs or seqs[-1] != pub.seq:
            assert time.monotonic() < deadline, "the subscriber stopped receiving"
            msg = await receive(sub, 0.2)
            if msg is None:
                await pub.publish(TOPIC, b"marker")
            else:
                seqs.append(msg.seq)
        assert seqs == sorted(seqs) and len(seqs) < pub.seq - before  # ZMQ did drop
        assert sub.gaps >= 1
        assert sub.missed - missed_before == (pub.seq - before) - len(seqs)
    finally:
        await plane.close()


async def test_publishers_of_one_scope_share_a_socket_and_a_registration(
    mem_plane: tuple[MemStore, ZmqEventPlane],
) -> None:
    store, plane = mem_plane
    first = await plane.publisher("ns", "worker", TOPIC)
    second = await plane.publisher("ns", "worker", TOPIC)
    assert first.address == second.address and first.key == second.key
    assert first.key == event_channel_key("ns", "worker", TOPIC, plane.lease.id)
    await first.publish(TOPIC, b"a")
    await second.publish(TOPIC, b"b")
    assert first.seq == second.seq == 2  # one sequence per socket, as subscribers see it
    assert list(await store.get_prefix(EVENT_CHANNELS_ROOT)) == [first.key]

    await first.close()
    assert await store.get(second.key) is not None  # still used by the second worker
    await second.publish(TOPIC, b"c")
    await second.close()
    assert await store.get(second.key) is None

    with pytest.raises(InvalidRequestError):
        await (await plane.publisher("ns", "worker", TOPIC)).publish(TOPIC_KV_METRICS, b"wrong topic")


async def test_durability_is_refused_with_a_pointer_to_nats(
    mem_plane: tuple[MemStore, ZmqEventPlane],
) -> None:
    _, plane = mem_plane
    with pytest.raises(ConfigError, match="nats"):
        await plane.publisher("ns", "worker", TOPIC, durable=True)
    with pytest.raises(ConfigError, match="nats"):
        await plane.subscribe("ns", "worker", TOPIC, durable_name="router")


async def test_a_burst_larger_than_one_read_batch_arrives_whole_and_in_order(
    mem_plane: tuple[MemStore, ZmqEventPlane],
) -> None:
    """The subscriber reads from its fd callback in batches; what is left after a batch must be
    read without waiting for another message to wake the socket (the burst's tail has none)."""
    from dynamod.shared.events.zmq_subscriber import _RECV_BATCH

    _, plane = mem_plane
    sub = await plane.subscribe("ns", "worker", TOPIC)
    pub = await plane.publisher("ns", "worker", TOPIC)
    await wait_for(lambda: sub.publishers, 5, "the subscriber to connect")

    async def probe() -> None:
        await pub.publish(TOPIC, b"probe")

    await prime(probe, sub, {plane.lease.id})
    first = pub.seq + 1
    count = 3 * _RECV_BATCH + 7
    for i in range(count):
        await pub.publish(TOPIC, b"m%d" % i)
    got = await collect(sub, count)
    assert [m.seq for m in got] == list(range(first, first + count))
    assert [m.payload for m in got] == [b"m%d" % i for i in range(count)]
    assert sub.dropped == 0 and sub.gaps == 0
