"""JetStream side of the NATS event plane: the per-(namespace, topic) stream and durable consumers.

Durability is opt-in (``publisher(..., durable=True)``, ``subscribe(..., durable_name=...)``)
because most events are state updates that a fresh snapshot (``kv_dump``, load polling) replaces.
Where a consumer must not miss anything while it is down, the stream keeps messages within size
and age limits and a *durable pull consumer* remembers how far that consumer got.

Pull rather than push: the subscriber fetches only as many messages as its bounded queue can take,
so a slow consumer applies backpressure to the server instead of losing messages, and a fetch
simply fails and is retried across a reconnect (no push subscription state to re-establish).
Messages are acknowledged when the application takes them from the iterator, so delivery is
at-least-once: a message fetched but not yet taken when the process dies is delivered again.

A stream captures *subjects*, not publishers: once it exists, what non-durable publishers send on
its subjects is stored too (within the same limits), so a durable consumer sees the whole topic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig

from dynamod.shared.errors import ConfigError, EventPlaneError
from dynamod.shared.events.nats_subjects import consumer_name, scope_subject, stream_name, stream_subject
from dynamod.shared.events.plane import EventMessage

logger = logging.getLogger(__name__)

_JS_API_TIMEOUT_S = 5.0
_FETCH_BATCH = 64
_FETCH_WAIT_S = 0.5  # how long one pull request lingers on the server waiting for messages
_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 2.0
_ACK_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Bounds of an event stream: JetStream discards the oldest messages beyond them."""

    max_bytes: int = 256 * 1024 * 1024
    max_age_s: float = 3600.0
    max_msgs: int = 1_000_000
    duplicate_window_s: float = 120.0  # publishers retry with a Nats-Msg-Id; the server dedups


async def ensure_stream(js: JetStreamContext, namespace: str, topic: str, limits: StreamLimits) -> str:
    """Creates the stream for (namespace, topic) if it does not exist; returns its name.

    An existing stream is left as it is (an operator may have tuned its limits).
    """
    name = stream_name(namespace, topic)
    try:
        await js.stream_info(name)
        return name
    except nats.js.errors.NotFoundError:
        pass
    except (
        nats.js.errors.ServiceUnavailableError,
        nats.errors.NoRespondersError,
        nats.errors.TimeoutError,
    ) as exc:
        raise EventPlaneError(
            "JetStream is not enabled on this NATS server (durable events need nats-server started with -js); "
            f"no answer to a stream lookup ({type(exc).__name__})"
        ) from exc
    config = StreamConfig(
        name=name,
        description=f"dynamod events topic={topic} namespace={namespace}",
        subjects=[stream_subject(namespace, topic)],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_bytes=limits.max_bytes,
        max_age=limits.max_age_s,
        max_msgs=limits.max_msgs,
        duplicate_window=limits.duplicate_window_s,
    )
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        # Another process may have created it between our lookup and add; that is fine.
        try:
            await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            raise EventPlaneError(f"cannot create JetStream stream {name}: {exc.description or exc}") from exc
    except (TimeoutError, nats.errors.Error) as exc:
        raise EventPlaneError(f"cannot create JetStream stream {name}: {exc}") from exc
    logger.info(
        "event stream created stream=%s subjects=%s max_bytes=%d max_age_s=%.0f",
        name,
        config.subjects[0],
        limits.max_bytes,
        limits.max_age_s,
    )
    return name


class NatsDurableSubscriber:
    """Iterates a durable pull consumer; a restarted subscriber resumes where the last one stopped."""

    def __init__(
        self,
        js: JetStreamContext,
        namespace: str,
        component: str,
        topic: str,
        durable_name: str,
        *,
        queue_size: int,
        on_close: Callable[[NatsDurableSubscriber], None] | None = None,
    ) -> None:
        self.namespace = namespace
        self.component = component
        self.topic = topic
        self.durable_name = consumer_name(durable_name)
        self.subject = scope_subject(namespace, component, topic)
        self._js = js
        # Bounded, and the fetcher waits when it is full: durable messages are never dropped here,
        # the server keeps them until there is room.
        self._queue: asyncio.Queue[Msg] = asyncio.Queue(queue_size)
        self._fetcher: asyncio.Task[None] | None = None
        self._on_close = on_close
        self._closed = asyncio.Event()
        self._space = asyncio.Event()  # set by the consumer when it takes a message
        self.received = 0
        self.dropped = 0  # always 0: kept so all subscribers expose the same counters
        self.ack_failures = 0

    async def start(self, limits: StreamLimits) -> None:
        stream = await ensure_stream(self._js, self.namespace, self.topic, limits)
        await self._ensure_consumer(stream)
        try:
            psub = await self._js.pull_subscribe_bind(durable=self.durable_name, stream=stream)
        except nats.errors.Error as exc:
            raise EventPlaneError(f"cannot bind durable consumer {self.durable_name}: {exc}") from exc
        self._fetcher = asyncio.create_task(self._fetch_loop(psub), name=f"nats-durable-{self.durable_name}")
        logger.info(
            "durable subscription started consumer=%s stream=%s subject=%s",
            self.durable_name,
            stream,
            self.subject,
        )

    async def _ensure_consumer(self, stream: str) -> None:
        try:
            info = await self._js.consumer_info(stream, self.durable_name, timeout=_JS_API_TIMEOUT_S)
        except nats.js.errors.NotFoundError:
            info = None
        except (TimeoutError, nats.errors.Error) as exc:
            raise EventPlaneError(f"cannot look up durable consumer {self.durable_name}: {exc}") from exc
        if info is not None:
            existing = info.config.filter_subject
            if existing != self.subject:
                raise ConfigError(
                    f"durable consumer {self.durable_name!r} on stream {stream} already filters {existing!r}, "
                    f"not {self.subject!r}; use another durable_name for this scope"
                )
            return
        config = ConsumerConfig(
            name=self.durable_name,
            durable_name=self.durable_name,
            description=f"dynamod durable subscriber subject={self.subject}",
            filter_subject=self.subject,
            # A new consumer starts at new messages like a plain subscription; from then on the
            # server remembers its position, so the consumer's downtime is what it catches up on.
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=_ACK_WAIT_S,
            max_ack_pending=self._queue.maxsize + _FETCH_BATCH,
        )
        try:
            await self._js.add_consumer(stream, config, timeout=_JS_API_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as exc:
            raise EventPlaneError(f"cannot create durable consumer {self.durable_name}: {exc}") from exc

    async def _fetch_loop(self, psub: JetStreamContext.PullSubscription) -> None:
        delay = _RETRY_MIN_S
        try:
            while not self._closed.is_set():
                free = self._queue.maxsize - self._queue.qsize()
                if free == 0:  # the consumer is behind: leave the messages on the server
                    self._space.clear()
                    await _first(self._space.wait(), self._closed.wait())
                    continue
                try:
                    # Never interrupted by close(): a cancelled fetch would leave its pull request
                    # on the server, which would hand the next messages to a dead inbox.
                    msgs = await psub.fetch(min(_FETCH_BATCH, free), timeout=_FETCH_WAIT_S)
                except TimeoutError:  # includes nats' TimeoutError: nothing new, or server away
                    continue
                except (nats.errors.Error, OSError) as exc:  # disconnected, consumer briefly missing
                    logger.debug(
                        "durable fetch failed consumer=%s error=%r retry_s=%.1f",
                        self.durable_name,
                        exc,
                        delay,
                    )
                    await _first(asyncio.sleep(delay), self._closed.wait())  # backoff, not synchronization
                    delay = min(_RETRY_MAX_S, delay * 2)
                    continue
                except Exception:  # noqa: BLE001 - the loop must outlive surprises; they are logged
                    logger.exception("durable fetch error consumer=%s retry_s=%.1f", self.durable_name, delay)
                    await _first(asyncio.sleep(delay), self._closed.wait())
                    delay = min(_RETRY_MAX_S, delay * 2)
                    continue
                delay = _RETRY_MIN_S
                for msg in msgs:
                    self._queue.put_nowait(msg)  # the batch was sized to the free space
        finally:
            await self._return_unconsumed()
            try:
                await psub.unsubscribe()  # only the inbox; the durable consumer stays on the server
            except (nats.errors.Error, ValueError):
                pass

    async def _return_unconsumed(self) -> None:
        """NAKs what was fetched but never taken, so the next subscriber of this durable name gets it
        right away instead of after ``ack_wait``."""
        while not self._queue.empty():
            msg = self._queue.get_nowait()
            try:
                await msg.nak()
            except (nats.errors.Error, OSError):
                return  # the server redelivers after ack_wait anyway

    def __aiter__(self) -> AsyncIterator[EventMessage]:
        return self

    async def __anext__(self) -> EventMessage:
        if self._closed.is_set():
            raise StopAsyncIteration
        if self._queue.empty():
            getter = asyncio.ensure_future(self._queue.get())
            closer = asyncio.ensure_future(self._closed.wait())
            try:
                await asyncio.wait({getter, closer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closer.cancel()
                if not getter.done():
                    getter.cancel()
            if not getter.done() or getter.cancelled():
                raise StopAsyncIteration
            msg = getter.result()
        else:
            msg = self._queue.get_nowait()
        self._space.set()
        try:
            await msg.ack()
        except (nats.errors.Error, OSError) as exc:
            # Not acknowledged means redelivered after ack_wait: a duplicate, never a loss.
            self.ack_failures += 1
            logger.debug("durable ack failed consumer=%s error=%r", self.durable_name, exc)
        self.received += 1
        return EventMessage(topic=self.topic, payload=msg.data)

    async def close(self) -> None:
        """Stops fetching after the pull request in flight ends (at most ``_FETCH_WAIT_S``) and
        returns unconsumed messages to the server. The durable consumer stays, so a later
        subscriber with the same name resumes where this one stopped."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._fetcher is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._fetcher), _FETCH_WAIT_S + _JS_API_TIMEOUT_S)
            except TimeoutError:
                self._fetcher.cancel()
                await asyncio.gather(self._fetcher, return_exceptions=True)
        if self._on_close is not None:
            self._on_close(self)


async def _first(*aws: Awaitable[object]) -> None:
    """Waits until the first of ``aws`` completes and cancels the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
