"""The ZMQ event plane: no broker, publishers found through discovery.

Each publisher binds a PUB socket on ``host`` (an ephemeral port) and registers
``v1/event_channels/{ns}/{component}/{topic}/{instance_id:x}`` -> ``{"address", "pid"}`` under the
process's lease, so it vanishes from discovery when the process dies. Subscribers watch that prefix
and connect a SUB socket to each publisher as it appears (see ``zmq_subscriber``). Frames are
vLLM's ``[topic, seq u64 big-endian, payload]``, ``seq`` starting at 1 per publisher, so a
subscriber can count what it lost.

One publisher per (namespace, component, topic) per plane: several workers in one process share
its socket and its sequence (a second PUB socket would register a second key for the same instance
id). Each caller gets its own handle; the socket closes when the last handle does.

No durability: ``durable=True`` is refused. A consumer that must not drift (the KV router) watches
``publisher_id``/``seq`` and re-reads the publisher's state (``kv_dump``) on a gap or when it first
sees a publisher. That also covers ZMQ's *slow joiner*: a SUB socket that just connected misses what
was published before the TCP connection and subscription handshake completed (a few ms), and
nothing resends it.

With the cluster token configured (``curve``), every PUB socket is a CURVE server and the context
runs a ZAP handler admitting only member clients; subscribers dial as CURVE clients of the member
server key. Without the token (loopback ``dynamod up``) the sockets are plain, as the request plane
is open then. See ``shared/security/curve.py`` for what that protects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

import zmq
import zmq.asyncio

from dynamod.shared.discovery.store import DiscoveryStore, Lease
from dynamod.shared.errors import ConfigError, DiscoveryError, EventPlaneError, InvalidRequestError
from dynamod.shared.events.plane import ConnectionListener
from dynamod.shared.events.zmq_subscriber import ZmqEventSubscriber
from dynamod.shared.protocol.keys import event_channel_key
from dynamod.shared.security.curve import CurveKeys
from dynamod.shared.security.zmq_gate import CurveGate
from dynamod.shared.transport.address import advertised_host, join_host_port

logger = logging.getLogger(__name__)

DEFAULT_HWM = 10_000  # messages a socket queues per peer before ZMQ drops (PUB) or stops reading (SUB)
DEFAULT_SUBSCRIBER_QUEUE = 10_000
_CLOSE_LINGER_MS = 200  # lets messages already queued on a closing PUB socket still go out

_Scope = tuple[str, str, str]


class ZmqEventPlane:
    """Publishers and subscribers of one process, registered under its discovery lease.

    ``host`` is where PUB sockets bind (the runtime's ``--host``); discovery gets the address
    subscribers should dial: ``advertise_host`` (``--advertise-host``) when given, else ``host``
    itself, or this node's primary address when ``host`` is a wildcard (0.0.0.0 is not an address
    another machine can use). ``curve``: the member keys (from the cluster token); None: plain.
    """

    name = "zmq"

    def __init__(
        self,
        store: DiscoveryStore,
        lease: Lease,
        *,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        sndhwm: int = DEFAULT_HWM,
        rcvhwm: int = DEFAULT_HWM,
        subscriber_queue: int = DEFAULT_SUBSCRIBER_QUEUE,
        curve: CurveKeys | None = None,
    ) -> None:
        self.store = store
        self.lease = lease
        self.host = host
        self.advertise_host = advertised_host(host, advertise_host)
        self.sndhwm = sndhwm
        self.rcvhwm = rcvhwm
        self.subscriber_queue = subscriber_queue
        self.curve = curve
        self._gate: CurveGate | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._channels: dict[_Scope, _ZmqChannel] = {}
        self._subscribers: set[ZmqEventSubscriber] = set()
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context(io_threads=1)
            if self.curve is not None:
                # Before any PUB socket binds: a CURVE server with no ZAP handler in its context
                # admits any client that knows its public key.
                self._gate = CurveGate(self._ctx, self.curve)
                self._gate.start()

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        """No broker to lose: a publisher that goes away is a gap in its own sequence numbers."""

    async def close(self) -> None:
        """Closes subscribers and publishers (their discovery keys are deleted) and the context."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(s.close() for s in list(self._subscribers)), return_exceptions=True)
        for channel in list(self._channels.values()):
            await channel.shutdown()
        self._channels.clear()
        if self._gate is not None:
            await self._gate.close()
            self._gate = None
        if self._ctx is not None:
            # term() waits for lingering sockets; do that off the event loop.
            await asyncio.to_thread(self._ctx.term)
            self._ctx = None

    def stats(self) -> dict[str, int]:
        """Counters for metrics: consumer-side drops and the sequence holes subscribers saw."""
        subs = list(self._subscribers)
        return {
            "subscribe_dropped": sum(s.dropped for s in subs),
            "gaps": sum(s.gaps for s in subs),
            "missed": sum(s.missed for s in subs),
            "publishers": len(self._channels),
            "handshake_failures": sum(s.handshake_failures for s in subs),
            "rejected_subscribers": self._gate.rejected if self._gate is not None else 0,
        }

    async def publisher(
        self, namespace: str, component: str, topic: str, *, durable: bool = False
    ) -> ZmqEventPublisher:
        """A handle on this process's PUB socket for the scope (created and registered on first use)."""
        if durable:
            raise ConfigError(
                "the zmq event plane keeps no history (durable=True); use --event-plane nats for durable events"
            )
        if component == "*":
            raise InvalidRequestError("a publisher needs a concrete component, not '*'", param="component")
        ctx = self._require_started()
        scope = (namespace, component, topic)
        async with self._lock:
            channel = self._channels.get(scope)
            if channel is None:
                channel = await self._open_channel(ctx, scope)
                self._channels[scope] = channel
            channel.refs += 1
        return ZmqEventPublisher(self, channel)

    async def subscribe(
        self, namespace: str, component: str, topic: str, *, durable_name: str | None = None
    ) -> ZmqEventSubscriber:
        """Connects to every publisher of ``topic`` in ``namespace/component`` (``"*"``: every
        component), now and as they come and go. Messages from before a connection completes are
        not seen (slow joiner); ``seq`` gaps after that are counted in ``subscriber.gaps``."""
        if durable_name is not None:
            raise ConfigError(
                "the zmq event plane has no durable consumers (durable_name); use --event-plane nats for them"
            )
        ctx = self._require_started()
        sub = ZmqEventSubscriber(
            ctx,
            self.store,
            namespace,
            component,
            topic,
            rcvhwm=self.rcvhwm,
            queue_size=self.subscriber_queue,
            on_close=self._subscribers.discard,
            curve=self.curve,
        )
        await sub.start()
        self._subscribers.add(sub)
        return sub

    def _require_started(self) -> zmq.asyncio.Context:
        if self._closed:
            raise EventPlaneError("zmq event plane is closed")
        if self._ctx is None:
            raise EventPlaneError("zmq event plane is not started; call start() first")
        return self._ctx

    async def _open_channel(self, ctx: zmq.asyncio.Context, scope: _Scope) -> _ZmqChannel:
        namespace, component, topic = scope
        instance_id = self.lease.id
        key = event_channel_key(namespace, component, topic, instance_id)
        sock = ctx.socket(zmq.PUB)
        # HWM must be set before bind/connect: ZMQ applies it to a pipe when the pipe is created.
        sock.setsockopt(zmq.SNDHWM, self.sndhwm)
        sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        # Pre-auth limits, as on the request plane: a peer that does not finish the ZMTP (CURVE)
        # handshake in 5 s is dropped, and inbound messages (subscriptions: topic prefixes) over
        # 64 KiB drop the peer instead of being buffered.
        sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        if self.curve is not None:
            self.curve.make_server(sock)
        bind_host = self.host or "*"
        if ":" in bind_host:
            sock.setsockopt(zmq.IPV6, 1)
            bind_host = bind_host if bind_host.startswith("[") else f"[{bind_host}]"
        try:
            sock.bind(f"tcp://{bind_host}:0")
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise EventPlaneError(f"cannot bind a ZMQ PUB socket on {self.host}: {exc}") from exc
        port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        address = f"tcp://{join_host_port(self.advertise_host, port)}"
        value = json.dumps({"address": address, "pid": os.getpid()}).encode()
        try:
            await self.store.put(key, value, lease=self.lease)
        except DiscoveryError:
            sock.close(linger=0)
            raise
        logger.info(
            "event publisher registered backend=zmq key=%s address=%s auth=%s",
            key, address, "curve" if self.curve is not None else "none",
        )
        return _ZmqChannel(self, scope, key, address, sock)

    def _release(self, channel: _ZmqChannel) -> None:
        if self._channels.get(channel.scope) is channel:
            del self._channels[channel.scope]


class _ZmqChannel:
    """One registered PUB socket and its sequence counter, shared by the handles of a scope."""

    def __init__(
        self, plane: ZmqEventPlane, scope: _Scope, key: str, address: str, sock: zmq.asyncio.Socket
    ) -> None:
        self.plane = plane
        self.scope = scope
        self.topic = scope[2]
        self.topic_bytes = scope[2].encode()
        self.key = key
        self.address = address
        self.socket = sock
        # The same socket without asyncio futures: the send that is taken almost always.
        self._plain = zmq.Socket.shadow(sock.underlying)
        self._waiting = 0  # awaitable sends in progress (ZMQ said "again")
        self.seq = 0
        self.refs = 0
        self.closed = False

    async def send(self, payload: bytes) -> None:
        self.seq += 1
        frames = [self.topic_bytes, self.seq.to_bytes(8, "big"), payload]
        # A PUB socket never blocks: past SNDHWM for a slow subscriber ZMQ drops for that one only,
        # and that subscriber sees the hole in seq. So a plain non-blocking send (~3 us) almost
        # always succeeds at once; pyzmq's awaitable send (~9 us: a future and a poller update per
        # message) is kept for the case where ZMQ still says "again", which then waits for room
        # instead of losing the message here.
        # While one such send waits, later ones queue behind it, so the order on the wire stays seq order.
        if not self._waiting:
            try:
                self._plain.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        self._waiting += 1
        try:
            await self.socket.send_multipart(frames)
        finally:
            self._waiting -= 1

    async def shutdown(self) -> None:
        """Deregisters first (subscribers disconnect), then closes the socket."""
        if self.closed:
            return
        self.closed = True
        self.plane._release(self)
        try:
            await self.plane.store.delete(self.key)
        except DiscoveryError as exc:
            # The key is under the lease: it still goes when the lease does.
            logger.warning("event publisher deregistration failed key=%s error=%s", self.key, exc)
        self.socket.close()
        logger.info("event publisher closed backend=zmq key=%s published=%d", self.key, self.seq)


class ZmqEventPublisher:
    """A caller's handle on a shared PUB socket; ``close`` releases only this handle."""

    def __init__(self, plane: ZmqEventPlane, channel: _ZmqChannel) -> None:
        self._plane = plane
        self._channel = channel
        self._closed = False
        self.topic = channel.topic
        self.key = channel.key
        self.address = channel.address

    @property
    def seq(self) -> int:
        """The last sequence number sent on the shared socket (0 before the first message)."""
        return self._channel.seq

    async def publish(self, topic: str, payload: bytes) -> None:
        if self._closed or self._channel.closed:
            raise EventPlaneError(f"publisher {self.key} is closed")
        if topic != self.topic:
            raise InvalidRequestError(
                f"this publisher was created for topic {self.topic!r}, not {topic!r}; create one per topic",
                param="topic",
            )
        await self._channel.send(payload)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._plane._lock:
            self._channel.refs -= 1
            if self._channel.refs > 0:
                return
            await self._channel.shutdown()
