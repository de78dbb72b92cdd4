"""ZMQ subscriber: follows the publishers registered in discovery and merges their streams.

One SUB socket per publisher rather than one socket connected to all of them: ZMQ does not say
which peer a message came from, and the consumer needs ``publisher_id`` (parsed from the discovery
key) to attribute ``seq`` and detect loss per publisher. Each socket's frames go into one bounded
drop-oldest queue, which the iterator reads.

Frames are read by a callback on the socket's ZMQ file descriptor with plain non-blocking receives,
not by awaiting pyzmq's asyncio ``recv_multipart``: that builds a future and re-arms its poller for
every message, which at a KV router's thousands of events a second was a visible share of a
frontend's CPU. The descriptor is edge-like (it signals a change, not "readable"), so a wake-up reads
until ``zmq.Again``; a batch cap hands the loop back to other work between batches.

With CURVE on, each socket also has a monitor: a publisher that fails the handshake (not a member:
another cluster's token, or a forged channel record) delivers nothing by construction, and the
monitor makes that visible as ``handshake_failures`` and one warning per publisher.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dynamod.shared.discovery.store import DiscoveryStore, WatchEvent, WatchEventKind
from dynamod.shared.errors import DiscoveryError
from dynamod.shared.events.plane import EventMessage
from dynamod.shared.events.queued_subscriber import QueuedSubscriber
from dynamod.shared.events.seq import Arrival, EventSequences
from dynamod.shared.protocol.keys import EVENT_CHANNELS_ROOT, event_channels_prefix, parse_key
from dynamod.shared.security.curve import CurveKeys

logger = logging.getLogger(__name__)

_RETRY_MIN_S = 0.2
_RETRY_MAX_S = 5.0
_RECV_BATCH = 256
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(slots=True)
class _Connection:
    key: str
    publisher_id: int
    address: str
    socket: zmq.asyncio.Socket
    reader: zmq.Socket | None = None  # the same socket without asyncio futures: read from the fd callback
    fd: int | None = None  # registered with the loop's add_reader while connected
    closed: bool = False
    monitor: zmq.asyncio.Socket | None = None
    monitor_task: asyncio.Task[None] | None = None
    handshake_failures: int = 0


class ZmqEventSubscriber(QueuedSubscriber):
    """Iterates events of one topic from every matching publisher; counts drops and seq gaps."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        store: DiscoveryStore,
        namespace: str,
        component: str,
        topic: str,
        *,
        rcvhwm: int,
        queue_size: int,
        on_close: Callable[[ZmqEventSubscriber], None] | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(namespace, component, topic, queue_size=queue_size)
        self._topic_bytes = topic.encode()
        self._ctx = ctx
        self._store = store
        self._rcvhwm = rcvhwm
        self._on_close = on_close
        self._curve = curve
        # Narrowest prefix discovery can filter on; "*" watches the whole namespace and filters here.
        self._prefix = (
            event_channels_prefix(namespace)
            if component == "*"
            else event_channels_prefix(namespace, component, topic)
        )
        self._conns: dict[str, _Connection] = {}
        # Publishers number from 1, but a subscriber joins running ones: the first frame seen is
        # the baseline (the slow-joiner window is not a loss).
        self._seqs: EventSequences[str] = EventSequences(first=None)
        self._watcher: asyncio.Task[None] | None = None
        self.malformed = 0
        self._past_handshake_failures = 0  # of publishers already disconnected

    # -- counters ----------------------------------------------------------------------------

    @property
    def gaps(self) -> int:
        """Sequence discontinuities seen across publishers (each one is at least one lost event)."""
        return self._seqs.counts.gaps

    @property
    def missed(self) -> int:
        """Events known lost: the sum of the holes in every publisher's ``seq``."""
        return self._seqs.counts.missed

    @property
    def handshake_failures(self) -> int:
        """CURVE handshakes that failed (publishers that are not members); 0 with CURVE off."""
        return self._past_handshake_failures + sum(c.handshake_failures for c in self._conns.values())

    @property
    def publishers(self) -> dict[str, str]:
        """Discovery key -> address of every publisher this subscriber is connected to."""
        return {key: conn.address for key, conn in self._conns.items()}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connects to the publishers registered now, then follows discovery in the background."""
        self._sync(await self._store.get_prefix(self._prefix))
        self._watcher = asyncio.create_task(self._watch_loop(), name=f"zmq-sub-watch-{self._prefix}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        for key in list(self._conns):
            self._disconnect(key)
        self._queue.close()
        if self._on_close is not None:
            self._on_close(self)

    # -- discovery ---------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        delay = _RETRY_MIN_S
        resync = False
        while True:
            watch = self._store.watch_prefix(self._prefix)
            try:
                if resync:
                    # Changes made while the watch was down produced no DELETEs for us: reconcile.
                    self._sync(await self._store.get_prefix(self._prefix))
                    logger.info(
                        "event subscriber watch resumed prefix=%s publishers=%d",
                        self._prefix,
                        len(self._conns),
                    )
                async for event in watch:
                    delay = _RETRY_MIN_S
                    self._apply(event)
                return  # the store closed the watch: it is shutting down
            except DiscoveryError as exc:
                logger.warning(
                    "event subscriber watch failed prefix=%s error=%s retry_s=%.1f", self._prefix, exc, delay
                )
            finally:
                aclose = getattr(watch, "aclose", None)
                if aclose is not None:
                    await aclose()
            resync = True
            await asyncio.sleep(delay)  # backoff before re-watching, not synchronization
            delay = min(_RETRY_MAX_S, delay * 2)

    def _sync(self, entries: dict[str, bytes]) -> None:
        wanted = {key: value for key, value in entries.items() if self._matches(key)}
        for key in list(self._conns):
            if key not in wanted:
                self._disconnect(key)
        for key, value in wanted.items():
            self._connect(key, value)

    def _apply(self, event: WatchEvent) -> None:
        if not self._matches(event.key):
            return
        if event.kind is WatchEventKind.DELETE:
            self._disconnect(event.key)
        elif event.value is not None:
            self._connect(event.key, event.value)

    def _matches(self, key: str) -> bool:
        parsed = parse_key(key)
        return (
            parsed is not None
            and parsed.root == EVENT_CHANNELS_ROOT
            and parsed.namespace == self.namespace
            and parsed.name == self.topic
            and (self.component == "*" or parsed.component == self.component)
        )

    # -- sockets -----------------------------------------------------------------------------

    def _connect(self, key: str, value: bytes) -> None:
        if self._closed:
            return
        try:
            address = str(json.loads(value)["address"])
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("event channel ignored key=%s reason=bad value error=%r", key, exc)
            return
        current = self._conns.get(key)
        if current is not None:
            if current.address == address:
                return  # a re-put (lease re-granted, watch resumed): same publisher
            self._disconnect(key)  # same instance, new socket: a new sequence starts
        for other, conn in list(self._conns.items()):
            if conn.address == address:
                # An address belongs to one live publisher: the other key is stale (its DELETE was
                # missed) and its port was reused; keeping it would misattribute messages.
                self._disconnect(other)
        parsed = parse_key(key)
        assert parsed is not None  # _matches checked it
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)  # before connect, like SNDHWM before bind
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic_bytes)
        conn = _Connection(key, parsed.instance_id, address, sock)
        if self._curve is not None:
            self._curve.make_client(sock)
            conn.monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            self._close_sockets(conn)
            logger.warning("event channel ignored key=%s address=%s error=%s", key, address, exc)
            return
        if conn.monitor is not None:
            conn.monitor_task = asyncio.create_task(self._monitor_loop(conn), name=f"zmq-sub-monitor-{key}")
        conn.reader = zmq.Socket.shadow(sock.underlying)
        conn.fd = conn.reader.getsockopt(zmq.FD)
        loop = asyncio.get_running_loop()
        loop.add_reader(conn.fd, self._drain, conn)
        # The descriptor signals changes only: read once now in case one happened before add_reader.
        loop.call_soon(self._drain, conn)
        self._conns[key] = conn
        logger.info("event subscriber connected backend=zmq key=%s address=%s", key, address)

    def _disconnect(self, key: str) -> None:
        conn = self._conns.pop(key, None)
        if conn is None:
            return
        if conn.monitor_task is not None:
            conn.monitor_task.cancel()
        self._past_handshake_failures += conn.handshake_failures
        self._close_sockets(conn)
        self._seqs.forget(key)
        logger.info("event subscriber disconnected backend=zmq key=%s", key)

    @staticmethod
    def _close_sockets(conn: _Connection) -> None:
        conn.closed = True
        if conn.fd is not None:
            # Before the socket closes: its fd number may be reused by the next socket.
            asyncio.get_running_loop().remove_reader(conn.fd)
            conn.fd = None
        if conn.monitor is not None:
            # The monitor's inproc address is named after the socket's fd: stop it before the fd
            # can be reused by the next socket.
            conn.socket.disable_monitor()
            conn.monitor.close(linger=0)
        conn.socket.close(linger=0)

    async def _monitor_loop(self, conn: _Connection) -> None:
        """Counts failed CURVE handshakes; warns on the first one of each publisher (ZMQ retries
        the connection every ~100 ms, and every retry fails the same way)."""
        assert conn.monitor is not None
        try:
            while True:
                event = parse_monitor_message(await conn.monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    continue
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                conn.handshake_failures += 1
                if conn.handshake_failures == 1:
                    logger.warning(
                        "event subscriber refused publisher key=%s address=%s reason=curve_handshake_failed "
                        "hint=the publisher is not a member (another cluster token, or a forged channel record)",
                        conn.key,
                        conn.address,
                    )
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError:
            return  # the monitor socket was closed under us: the connection is going away

    def _drain(self, conn: _Connection) -> None:
        """Reads what the socket has queued (a batch at most), from the fd callback."""
        reader = conn.reader
        if conn.closed or reader is None:
            return
        try:
            for _ in range(_RECV_BATCH):
                try:
                    frames = reader.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return  # drained: the descriptor signals again when the next message arrives
                self._on_frames(conn, frames)
        except zmq.ZMQError as exc:
            if conn.fd is not None:
                asyncio.get_running_loop().remove_reader(conn.fd)
                conn.fd = None
            if not self._closed and self._conns.get(conn.key) is conn:
                logger.warning("event subscriber socket failed key=%s error=%s", conn.key, exc)
            return
        # A full batch: more may be waiting, and no new signal would come for it. Continue after
        # the callbacks already due, so a flood on one socket does not starve the loop.
        asyncio.get_running_loop().call_soon(self._drain, conn)

    def _on_frames(self, conn: _Connection, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            logger.debug("event frame ignored key=%s frames=%d", conn.key, len(frames))
            return
        topic, raw_seq, payload = frames
        if topic != self._topic_bytes:
            return  # SUBSCRIBE filters by prefix; "kv-events" must not take "kv-events-x"
        seq = int.from_bytes(raw_seq, "big")
        sequence = self._seqs.of(conn.key)
        expected = sequence.expected
        if sequence.observe(seq) is Arrival.GAP and expected is not None:
            logger.debug("event gap key=%s seq=%d missing=%d", conn.key, seq, seq - expected)
        self._queue.put_nowait(EventMessage(self.topic, payload, publisher_id=conn.publisher_id, seq=seq))
