"""The NATS event plane: core subjects for fire-and-forget events, JetStream where asked for.

Subjects are ``namespace.{ns}.component.{component}.{topic}`` (``nats_subject``); subscribing with
component ``"*"`` uses a one-token wildcard so one subscription sees every component.

Behaviour an operator relies on:

- ``start()`` fails fast with ``EventPlaneError`` naming the URL when no server answers, so a
  misconfigured ``--nats-server`` is one clear line, not a hang.
- After that the connection reconnects forever with capped exponential backoff and jitter (one log
  line when it drops, one when it is back), and nats-py replays the subscriptions, so subscribers
  keep receiving after a server restart without doing anything.
- ``publish`` never waits on the network for long. While the server is away, messages wait in a
  bounded per-publisher buffer; when it is full the *oldest* are dropped and counted
  (``publisher.dropped``): after an outage fresh events are worth more than old ones.
- A subscriber hands messages over through a bounded queue; a consumer slower than the stream loses
  the oldest messages, counted in ``subscriber.dropped``.
- ``publisher(..., durable=True)`` publishes to a JetStream stream (created if missing, bounded by
  size and age) and waits for the server's acknowledgement in the background, retrying with a
  message id so a retry is never stored twice. ``subscribe(..., durable_name="x")`` reads through a
  durable consumer, so a subscriber that was down receives what was published meanwhile.
- ``security`` logs in with TLS and credentials (``shared.security.nats``); a process configured
  for TLS refuses a server that does not use it, rather than publishing in the clear.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
import uuid
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.client import Server as NatsServerEntry
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from dynamod.shared.errors import EventPlaneError, InvalidRequestError
from dynamod.shared.events.dropqueue import DropOldestQueue
from dynamod.shared.events.nats_jetstream import NatsDurableSubscriber, StreamLimits, ensure_stream
from dynamod.shared.events.nats_subjects import scope_subject
from dynamod.shared.events.plane import ConnectionListener, EventMessage
from dynamod.shared.events.queued_subscriber import QueuedSubscriber
from dynamod.shared.security import nats as nats_security
from dynamod.shared.security.settings import NatsSecurity
from dynamod.shared.transport.nats_connect import connect_within

logger = logging.getLogger(__name__)

DEFAULT_PUBLISH_BUFFER = 10_000
DEFAULT_SUBSCRIBER_QUEUE = 10_000
_CLOSE_FLUSH_TIMEOUT_S = 2.0
_ACK_TIMEOUT_S = 2.0
_RETRY_MIN_S = 0.05
_RETRY_MAX_S = 2.0
# Errors that mean "the server is not there right now": the message waits and is sent later.
_TRANSIENT = (nats.errors.Error, OSError, TimeoutError)


class NatsEventPlane:
    """One NATS connection per process, shared by all its publishers and subscribers."""

    name = "nats"

    def __init__(
        self,
        url: str,
        *,
        name: str = "dynamod",
        connect_timeout_s: float = 3.0,
        publish_buffer: int = DEFAULT_PUBLISH_BUFFER,
        subscriber_queue: int = DEFAULT_SUBSCRIBER_QUEUE,
        stream_limits: StreamLimits | None = None,
        reconnect_wait_s: float = 0.1,
        reconnect_wait_max_s: float = 2.0,
        ping_interval_s: int = 10,
        security: NatsSecurity | None = None,
    ) -> None:
        self.url = url
        self._security = security
        self._connect_options = nats_security.connect_options(security, url)  # ConfigError now, not at start
        self.client_name = name
        self.connect_timeout_s = connect_timeout_s
        self.publish_buffer = publish_buffer
        self.subscriber_queue = subscriber_queue
        self.stream_limits = stream_limits or StreamLimits()
        self._reconnect_wait_s = reconnect_wait_s
        self._reconnect_wait_max_s = reconnect_wait_max_s
        self._ping_interval_s = ping_interval_s
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self._down_since: float | None = None
        self._last_error: BaseException | None = None
        self._publishers: set[NatsEventPublisher] = set()
        self._subscribers: set[NatsEventSubscriber | NatsDurableSubscriber] = set()
        self.disconnects = 0
        self.reconnects = 0
        self._listeners: list[ConnectionListener] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connects; raises EventPlaneError naming the URL if no server answers in time."""
        if self._nc is not None:
            return
        servers = [u.strip() for u in self.url.split(",") if u.strip()]
        if not servers:
            raise EventPlaneError("no NATS URL given (--nats-server / NATS_SERVER)")
        nc = NatsClient()
        connect = nc.connect(
            servers=servers,
            name=self.client_name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,  # an event plane outlives any server outage
            reconnect_time_wait=self._reconnect_wait_s,  # type: ignore[arg-type]  # only the initial attempts
            reconnect_to_server_handler=self._next_server,
            connect_timeout=max(1, int(self.connect_timeout_s)),
            ping_interval=self._ping_interval_s,
            max_outstanding_pings=2,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=self._on_closed,
            **self._connect_options,
        )
        try:
            await connect_within(connect, self.connect_timeout_s, nc.close, what="event plane nats")
        except (TimeoutError, *_TRANSIENT) as exc:
            self._closing = True
            try:
                await nc.close()
            finally:
                self._closing = False
            cause = self._last_error or exc
            hint = nats_security.refusal_hint(cause) or "is nats-server running? (--nats-server / NATS_SERVER)"
            raise EventPlaneError(
                f"cannot connect to NATS at {self.url} within {self.connect_timeout_s:g}s "
                f"({type(cause).__name__}: {cause}); {hint}"
            ) from exc
        refusal = nats_security.tls_missing(nc, self.url, self._security)
        if refusal is not None:
            self._closing = True
            try:
                await nc.close()
            finally:
                self._closing = False
            raise EventPlaneError(refusal)
        self._nc = nc
        self._js = nc.jetstream(timeout=_ACK_TIMEOUT_S)
        self._connected.set()
        logger.info("event plane connected backend=nats url=%s name=%s", self.url, self.client_name)

    async def close(self) -> None:
        """Flushes publishers (briefly), ends subscriptions, closes the connection."""
        if self._nc is None or self._closing:
            return
        self._closing = True
        await asyncio.gather(*(p.close() for p in list(self._publishers)), return_exceptions=True)
        await asyncio.gather(*(s.close() for s in list(self._subscribers)), return_exceptions=True)
        try:
            await self._nc.close()
        except _TRANSIENT as exc:
            logger.debug("nats close error=%r", exc)
        self._connected.clear()
        logger.info("event plane closed backend=nats url=%s", self.url)

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def wait_connected(self) -> None:
        await self._connected.wait()

    def stats(self) -> dict[str, int]:
        """Counters for metrics: drops on either side, disconnects and reconnects."""
        return {
            "publish_dropped": sum(p.dropped for p in self._publishers),
            "subscribe_dropped": sum(s.dropped for s in self._subscribers),
            "disconnects": self.disconnects,
            "reconnects": self.reconnects,
        }

    # -- publishers and subscribers ------------------------------------------------------------

    async def publisher(
        self, namespace: str, component: str, topic: str, *, durable: bool = False
    ) -> NatsEventPublisher:
        """A publisher for one scope. ``durable=True`` stores messages in the (namespace, topic)
        JetStream stream, created if missing."""
        nc, js = self._require_started()
        if component == "*":
            raise InvalidRequestError("a publisher needs a concrete component, not '*'", param="component")
        if durable:
            await ensure_stream(js, namespace, topic, self.stream_limits)
        pub = NatsEventPublisher(self, nc, js, namespace, component, topic, durable=durable)
        self._publishers.add(pub)
        return pub

    async def subscribe(
        self, namespace: str, component: str, topic: str, *, durable_name: str | None = None
    ) -> NatsEventSubscriber | NatsDurableSubscriber:
        """Subscribes to ``topic`` of ``namespace/component`` (``"*"``: every component).

        With ``durable_name`` the subscription reads a durable JetStream consumer of that name:
        messages published while no subscriber of that name was running are delivered when one is.
        """
        nc, js = self._require_started()
        if durable_name is not None:
            dsub = NatsDurableSubscriber(
                js,
                namespace,
                component,
                topic,
                durable_name,
                queue_size=self.subscriber_queue,
                on_close=self._forget,
            )
            await dsub.start(self.stream_limits)
            self._subscribers.add(dsub)
            return dsub
        sub = NatsEventSubscriber(self, namespace, component, topic, queue_size=self.subscriber_queue)
        await sub.start(nc)
        self._subscribers.add(sub)
        return sub

    def _forget(self, item: NatsEventPublisher | NatsEventSubscriber | NatsDurableSubscriber) -> None:
        self._publishers.discard(item)  # type: ignore[arg-type]
        self._subscribers.discard(item)  # type: ignore[arg-type]

    def _require_started(self) -> tuple[NatsClient, JetStreamContext]:
        if self._nc is None or self._js is None:
            raise EventPlaneError("NATS event plane is not started; call start() first")
        if self._closing or self._nc.is_closed:
            raise EventPlaneError(f"NATS event plane for {self.url} is closed")
        return self._nc, self._js

    # -- connection callbacks ------------------------------------------------------------------

    def _next_server(
        self, servers: list[NatsServerEntry], info: dict[str, Any]
    ) -> tuple[NatsServerEntry, float]:
        """Capped exponential backoff with jitter, so a fleet does not reconnect in lockstep."""
        server = min(servers, key=lambda s: s.reconnects)
        wait = min(self._reconnect_wait_max_s, self._reconnect_wait_s * (2 ** min(server.reconnects, 20)))
        return server, wait * random.uniform(0.5, 1.0)

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        self._listeners.append(listener)

    def _tell_listeners(self, connected: bool) -> None:
        for listener in list(self._listeners):
            try:
                listener(connected)
            except Exception:  # noqa: BLE001 - one listener's bug must not stop the others or the plane
                logger.exception("event plane connection listener failed connected=%s", connected)

    async def _on_error(self, exc: Exception) -> None:
        # The error that says most about why a first connection keeps failing (``says_more``).
        if nats_security.says_more(exc, self._last_error):
            self._last_error = exc
        if isinstance(exc, OSError | TimeoutError | nats.errors.StaleConnectionError):
            logger.debug("nats connection attempt failed url=%s error=%r", self.url, exc)
        else:
            logger.warning("nats error url=%s error=%r", self.url, exc)

    async def _on_disconnected(self) -> None:
        self._connected.clear()
        if self._closing or self._nc is None or self._down_since is not None:
            return
        self._down_since = time.monotonic()
        self.disconnects += 1
        logger.warning(
            "event plane disconnected backend=nats url=%s; reconnecting in the background", self.url
        )
        self._tell_listeners(False)

    async def _on_reconnected(self) -> None:
        down_s = time.monotonic() - self._down_since if self._down_since is not None else 0.0
        self._down_since = None
        self.reconnects += 1
        self._connected.set()
        nc = self._nc
        server = nc.connected_url.netloc if nc is not None and nc.connected_url is not None else self.url
        logger.info("event plane reconnected backend=nats server=%s down_s=%.1f", server, down_s)
        self._tell_listeners(True)

    async def _on_closed(self) -> None:
        self._connected.clear()
        if not self._closing and self._nc is not None:
            logger.error("event plane connection closed for good backend=nats url=%s", self.url)


class NatsEventPublisher:
    """Publishes one scope's topic. Never blocks the caller on the network for long."""

    def __init__(
        self,
        plane: NatsEventPlane,
        nc: NatsClient,
        js: JetStreamContext,
        namespace: str,
        component: str,
        topic: str,
        *,
        durable: bool,
    ) -> None:
        self.namespace = namespace
        self.component = component
        self.topic = topic
        self.durable = durable
        self.subject = scope_subject(namespace, component, topic)
        self._plane = plane
        self._nc = nc
        self._js = js
        # Items are (seq, payload); seq names a durable message for server-side dedup of retries.
        self._buffer: DropOldestQueue[tuple[int, bytes]] = DropOldestQueue(plane.publish_buffer)
        self._seq = itertools.count(1)
        self._msg_id_prefix = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._sending = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._sender = asyncio.create_task(self._send_loop(), name=f"nats-pub-{self.subject}")
        self.sent = 0

    @property
    def dropped(self) -> int:
        """Messages discarded (oldest first) because the buffer filled while the server was away."""
        return self._buffer.dropped

    @property
    def pending(self) -> int:
        return len(self._buffer)

    async def publish(self, topic: str, payload: bytes) -> None:
        if self._closed:
            raise EventPlaneError(f"publisher for {self.subject} is closed")
        if topic != self.topic:
            raise InvalidRequestError(
                f"this publisher was created for topic {self.topic!r}, not {topic!r}; create one per topic",
                param="topic",
            )
        if len(payload) > self._nc.max_payload:
            raise InvalidRequestError(
                f"event payload of {len(payload)} bytes exceeds the NATS max_payload of {self._nc.max_payload}"
            )
        seq = next(self._seq)
        if not self.durable and not self._sending and not len(self._buffer) and self._nc.is_connected:
            try:  # fast path: nothing queued ahead of this message, so order is kept
                await self._nc.publish(self.subject, payload)
                self.sent += 1
                return
            except _TRANSIENT as exc:
                logger.debug("nats publish deferred subject=%s error=%r", self.subject, exc)
        self._idle.clear()
        self._buffer.put_nowait((seq, payload))

    async def _send_loop(self) -> None:
        delay = _RETRY_MIN_S
        failing = False
        while True:
            if not len(self._buffer):
                self._idle.set()
            await self._buffer.wait_readable()
            await self._plane.wait_connected()
            if self._buffer.closed:
                return
            item = self._buffer.get_nowait()
            if item is None:
                continue
            self._sending = True
            try:
                await self._send(*item)
            except _TRANSIENT as exc:
                self._buffer.push_front(item)
                if not failing and self.durable:
                    logger.warning("durable publish failing subject=%s error=%r; retrying", self.subject, exc)
                failing = True
                logger.debug("nats publish retry subject=%s error=%r retry_s=%.2f", self.subject, exc, delay)
                await asyncio.sleep(delay)  # backoff between retries, not synchronization
                delay = min(_RETRY_MAX_S, delay * 2)
                continue
            finally:
                self._sending = False
            self.sent += 1
            delay = _RETRY_MIN_S
            if failing and self.durable:
                logger.info(
                    "durable publish recovered subject=%s pending=%d", self.subject, len(self._buffer)
                )
            failing = False

    async def _send(self, seq: int, payload: bytes) -> None:
        if self.durable:
            # Waits for the stream's ack so a message sent while JetStream was still recovering
            # after a restart is retried instead of silently lost; the id makes a retry idempotent.
            await self._js.publish(
                self.subject,
                payload,
                timeout=_ACK_TIMEOUT_S,
                headers={"Nats-Msg-Id": f"{self._msg_id_prefix}-{seq}"},
            )
        else:
            await self._nc.publish(self.subject, payload)

    async def flush(self, timeout: float = _CLOSE_FLUSH_TIMEOUT_S) -> bool:
        """Waits until everything buffered was handed to the server; False if it timed out."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        if self._nc.is_connected:
            try:  # twice: see NatsEventSubscriber.start on nats-py's PING overtaking pending data
                await self._nc.flush(timeout=max(1, int(timeout)))
                await self._nc.flush(timeout=max(1, int(timeout)))
            except _TRANSIENT:
                return False
        return True

    async def close(self) -> None:
        """Gives buffered messages a short chance to go out, then stops."""
        if self._closed:
            return
        self._closed = True
        if len(self._buffer) or self._sending:
            flushed = self._plane.connected and await self.flush()
            if not flushed:
                logger.warning(
                    "nats publisher closed with unsent events subject=%s pending=%d",
                    self.subject,
                    len(self._buffer),
                )
        self._buffer.close()
        self._sender.cancel()
        await asyncio.gather(self._sender, return_exceptions=True)
        self._plane._forget(self)


class NatsEventSubscriber(QueuedSubscriber):
    """A core NATS subscription feeding a bounded drop-oldest queue."""

    def __init__(
        self, plane: NatsEventPlane, namespace: str, component: str, topic: str, *, queue_size: int
    ) -> None:
        super().__init__(namespace, component, topic, queue_size=queue_size)
        self.subject = scope_subject(namespace, component, topic)
        self._plane = plane
        self._sub: Subscription | None = None

    async def start(self, nc: NatsClient) -> None:
        try:
            # The callback only enqueues, so nats-py's own per-subscription queue stays short.
            self._sub = await nc.subscribe(self.subject, cb=self._on_msg)
            if nc.is_connected:
                # A round trip so the server knows the interest when subscribe() returns, and a
                # message published right after (from any connection) reaches this subscriber.
                # Twice: nats-py writes the PING straight to the socket, ahead of the SUB still
                # waiting in its pending buffer, so only the second PONG proves the SUB arrived.
                timeout = max(1, int(self._plane.connect_timeout_s))
                await nc.flush(timeout=timeout)
                await nc.flush(timeout=timeout)
        except _TRANSIENT as exc:
            raise EventPlaneError(f"cannot subscribe to {self.subject} on {self._plane.url}: {exc}") from exc
        logger.debug("nats subscribed subject=%s", self.subject)

    async def _on_msg(self, msg: Msg) -> None:
        self._queue.put_nowait(EventMessage(topic=self.topic, payload=msg.data))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except _TRANSIENT as exc:
                logger.debug("nats unsubscribe failed subject=%s error=%r", self.subject, exc)
        self._plane._forget(self)
