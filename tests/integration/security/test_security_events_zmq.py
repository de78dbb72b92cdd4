"""The ZMQ event plane with the cluster token: CURVE on real loopback sockets.

Members (same token) exchange events; a subscriber without keys, with another cluster's keys, or
holding the leaked server key but not the member client key reads nothing; a publisher that is not
a member (plain, or another token) and got its channel into discovery delivers nothing to members.
"Nothing" is asserted after the refused handshake was observed and a member's later message has
arrived through the same path, so the negative checks cannot pass by being early.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.events.plane import TOPIC_KV_EVENTS, EventMessage
from dynamod.shared.events.zmq_plane import ZmqEventPlane
from dynamod.shared.events.zmq_subscriber import ZmqEventSubscriber
from dynamod.shared.security.curve import CurveKeys
from dynamod.shared.security.token import ClusterToken
from tests.fixtures.servers import wait_for

TOKEN = ClusterToken("member-token-0123456789abcdef")
OTHER = ClusterToken("another-cluster-token-0123456789")
NS, COMPONENT = "ns1", "worker"



async def next_message(sub: ZmqEventSubscriber, timeout: float) -> EventMessage | None:
    try:
        return await asyncio.wait_for(anext(sub), timeout)
    except TimeoutError:
        return None


async def deliver(pub, sub: ZmqEventSubscriber, payload: bytes, timeout: float = 15.0) -> list[EventMessage]:
    """Publishes ``payload`` until ``sub`` receives it (slow joiner); returns everything received
    on the way, so a caller can check nothing else came in."""
    got: list[EventMessage] = []
    deadline = time.monotonic() + timeout
    while not any(m.payload == payload for m in got):
        assert time.monotonic() < deadline, f"{payload!r} never arrived"
        await pub.publish(TOPIC_KV_EVENTS, payload)
        while (msg := await next_message(sub, 0.1)) is not None:
            got.append(msg)
    return got


@pytest.fixture
async def store() -> AsyncIterator[MemStore]:
    s = MemStore()
    await s.start()
    yield s
    await s.close()


@pytest.fixture
async def planes(store: MemStore) -> AsyncIterator[Callable]:
    made: list[ZmqEventPlane] = []

    async def make(curve: CurveKeys | None) -> ZmqEventPlane:
        plane = ZmqEventPlane(store, await store.create_lease(10.0), curve=curve)
        await plane.start()
        made.append(plane)
        return plane

    yield make
    for plane in made:
        await plane.close()


class RawSubscriber:
    """A SUB socket an outsider would open (plain blocking pyzmq), with a monitor to see its
    handshake fail."""

    def __init__(self, ctx: zmq.Context, address: str, setup: Callable[[zmq.Socket], None]) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        setup(self.sock)
        self.monitor = self.sock.get_monitor_socket()
        self.sock.connect(address)

    def _watch(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.monitor.poll(100):
                continue
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                raise AssertionError("an outsider completed the handshake")
            if event["event"] & (
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_DISCONNECTED
            ):
                return zmq.Event(event["event"]).name
        raise AssertionError(f"no handshake failure within {timeout}s")

    async def wait_refused(self, timeout: float = 10.0) -> str:
        """The name of the first handshake failure or disconnect the monitor reports."""
        return await asyncio.to_thread(self._watch, timeout)

    def drain(self) -> list[list[bytes]]:
        frames: list[list[bytes]] = []
        while True:
            try:
                frames.append(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


async def test_members_exchange_events_over_curve(planes) -> None:
    keys = CurveKeys.from_token(TOKEN)
    pub_plane, sub_plane = await planes(keys), await planes(keys)
    sub = await sub_plane.subscribe(NS, COMPONENT, TOPIC_KV_EVENTS)
    pub = await pub_plane.publisher(NS, COMPONENT, TOPIC_KV_EVENTS)
    got = await deliver(pub, sub, b"stored-1")
    assert {m.publisher_id for m in got} == {pub_plane.lease.id}
    assert sub.handshake_failures == 0
    assert pub_plane.stats()["rejected_subscribers"] == 0


@pytest.mark.parametrize(
    "outsider",
    ["no_key", "other_cluster_keys", "leaked_server_key"],
)
async def test_non_member_subscriber_reads_nothing(planes, outsider: str) -> None:
    keys, other = CurveKeys.from_token(TOKEN), CurveKeys.from_token(OTHER)
    pub_plane, member_plane = await planes(keys), await planes(keys)
    pub = await pub_plane.publisher(NS, COMPONENT, TOPIC_KV_EVENTS)
    member = await member_plane.subscribe(NS, COMPONENT, TOPIC_KV_EVENTS)

    def setup(sock: zmq.Socket) -> None:
        if outsider == "other_cluster_keys":
            other.make_client(sock)
        elif outsider == "leaked_server_key":
            # Knows the publisher's public key (it is not a secret) but not the member client key.
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, other.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, other.client_secret)

    ctx = zmq.Context()
    raw = RawSubscriber(ctx, pub.address, setup)
    try:
        await raw.wait_refused()
        if outsider == "leaked_server_key":
            # Only the ZAP handler can tell this one apart: the handshake itself is sound.
            assert pub_plane.stats()["rejected_subscribers"] >= 1
        # A member receives what was published after the refusal; the outsider got none of it.
        await deliver(pub, member, b"after-refusal")
        assert raw.drain() == []
    finally:
        raw.close()
        ctx.term()


@pytest.mark.parametrize("forger", ["plain", "other_cluster"])
async def test_forged_publisher_events_are_not_applied(planes, forger: str) -> None:
    keys = CurveKeys.from_token(TOKEN)
    member_pub_plane, sub_plane = await planes(keys), await planes(keys)
    # The forger got a channel record into discovery (same namespace, component and topic).
    forged_plane = await planes(None if forger == "plain" else CurveKeys.from_token(OTHER))
    sub = await sub_plane.subscribe(NS, COMPONENT, TOPIC_KV_EVENTS)
    forged = await forged_plane.publisher(NS, COMPONENT, TOPIC_KV_EVENTS)
    member = await member_pub_plane.publisher(NS, COMPONENT, TOPIC_KV_EVENTS)
    await wait_for(lambda: len(sub.publishers) == 2, 10, "the subscriber to dial both publishers")
    await wait_for(lambda: sub.handshake_failures >= 1, 10, "the forged publisher's handshake to fail")
    for i in range(20):
        await forged.publish(TOPIC_KV_EVENTS, f"forged-{i}".encode())
    got = await deliver(member, sub, b"genuine")
    assert {m.publisher_id for m in got} == {member_pub_plane.lease.id}
    assert not any(m.payload.startswith(b"forged") for m in got)
    assert sub_plane.stats()["handshake_failures"] >= 1


async def test_plain_planes_still_talk_without_a_token(planes) -> None:
    """Off by default: a loopback cluster with no token runs unauthenticated, as before."""
    pub_plane, sub_plane = await planes(None), await planes(None)
    sub = await sub_plane.subscribe(NS, COMPONENT, TOPIC_KV_EVENTS)
    pub = await pub_plane.publisher(NS, COMPONENT, TOPIC_KV_EVENTS)
    await deliver(pub, sub, b"plain")
    assert sub.handshake_failures == 0


async def test_runtime_with_the_cluster_token_publishes_over_curve(tmp_path) -> None:
    """The daemon path: ``--cluster-token-file`` reaches the event plane of every runtime."""
    from dynamod.shared.config import RuntimeSettings
    from dynamod.shared.runtime.distributed import DistributedRuntime
    from dynamod.shared.security.settings import RequestPlaneSecurity, SecuritySettings

    def settings(token: ClusterToken | None) -> RuntimeSettings:
        return RuntimeSettings(
            discovery_backend="file", file_kv=str(tmp_path / "kv"), event_plane="zmq",
            security=SecuritySettings(request_plane=RequestPlaneSecurity(token=token)),
        )

    pub_rt = await DistributedRuntime.create(settings(TOKEN))
    sub_rt = await DistributedRuntime.create(settings(TOKEN))
    outsider_rt = await DistributedRuntime.create(settings(None))
    try:
        assert pub_rt.events.curve == CurveKeys.from_token(TOKEN)
        assert outsider_rt.events.curve is None
        sub = await sub_rt.events.subscribe(NS, COMPONENT, TOPIC_KV_EVENTS)
        outsider = await outsider_rt.events.subscribe(NS, COMPONENT, TOPIC_KV_EVENTS)
        pub = await pub_rt.events.publisher(NS, COMPONENT, TOPIC_KV_EVENTS)
        await wait_for(lambda: outsider.publishers, 10, "the outsider to find the publisher")
        await deliver(pub, sub, b"through-the-runtime")
        assert await next_message(outsider, 0.2) is None
    finally:
        for rt in (pub_rt, sub_rt, outsider_rt):
            await rt.shutdown(grace_s=0)
