"""Feeds ``KvRouter``s from the cluster: KV events, load, ``kv_dump`` resyncs and replica sync.

The frontend (``--router-mode kv``, one router per base model) and the standalone router role
(``dynamod --role router``, one router per worker component) need exactly the same plumbing, so it
lives here once:

- ``kv-events`` and ``kv_metrics`` of every worker component a router routes to, subscribed when
  the first worker of that component is added, each message applied to the routers tracking
  that worker;
- a worker's cached blocks read from its ``kv_dump`` endpoint when a router first tracks it (it
  may have cached prompts before this process started) and whenever a router sees a gap in its
  event numbers (``KvRouter(on_resync=feed.request_resync)``);
- with replica sync, each router's active-sequence changes published on
  ``{namespace}/{sync_component}/active_sequences_events`` and the other replicas' changes
  applied, so every replica counts every request's load. Messages carry a key (the frontend's base
  model name, the router role's worker component) so replicas only merge the same router's view.

The caller decides which workers a router may route to (``KvRouter.update_workers``) and tells the
feed when a worker appears (``add_worker``) and leaves for good (``remove_worker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from dynamod.daemon.router.core.config import KvRouterConfig
from dynamod.daemon.router.core.kv_router import KvRouter
from dynamod.shared.errors import DynamoError
from dynamod.shared.events.plane import (
    TOPIC_ACTIVE_SEQUENCES,
    TOPIC_KV_EVENTS,
    TOPIC_KV_METRICS,
    EventPublisher,
    EventSubscriber,
)
from dynamod.shared.kv.router_sync import decode_sequence_event, encode_sequence_event
from dynamod.shared.observability.per_registry import PerRegistry
from dynamod.shared.protocol import control
from dynamod.shared.protocol.kv_events import RouterEvent, router_event_decoder
from dynamod.shared.protocol.load import load_decoder
from dynamod.shared.protocol.replica_sync import SyncEnvelope, sync_envelope_decoder, sync_envelope_encoder

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

RESYNC_TIMEOUT_S = 30.0  # a kv_dump of a large cache is a few MB; more than this means trouble
RESYNC_WAIT_INSTANCE_S = 5.0  # the worker's kv_dump endpoint may register just after generate
SUBSCRIPTION_SETTLE_S = 1.0  # after it, a new worker's events surely reach our subscription
RESYNC_RETRY_MIN_S = 0.5
RESYNC_RETRY_MAX_S = 10.0
SUBSCRIBE_RETRY_MIN_S = 0.2
SUBSCRIBE_RETRY_MAX_S = 5.0


class FeedMetrics:
    """Replica-sync and resync counters; how an operator (and a test) sees the replicas talk."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.sync_events = Counter(
            "dynamo_router_replica_sync_events",
            "Active-sequence changes exchanged with router replicas (published: ours; applied: theirs)",
            ("direction",),
            registry=registry,
        )
        self.sync_published = self.sync_events.labels("published")
        self.sync_applied = self.sync_events.labels("applied")
        self.resyncs = Counter(
            "dynamo_router_kv_resyncs",
            "Worker KV indexes rebuilt from kv_dump, by outcome",
            ("outcome",),
            registry=registry,
        )
        self.routers: weakref.WeakSet[KvRouter] = weakref.WeakSet()
        self.active_requests = Gauge(
            "dynamo_router_active_requests",
            "Requests the routers count as running on workers: their own and, with replica sync, their replicas'",
            registry=registry,
        )
        self.active_requests.set_function(lambda: float(sum(len(kv.active) for kv in list(self.routers))))
        self.events_outage = Gauge(
            "dynamo_router_kv_events_outage",
            "1 while the event plane's server is away and the routers route approximately",
            registry=registry,
        )
        self.events_outages = Counter(
            "dynamo_router_kv_events_outages",
            "Times the event plane's server went away (KV events lost; caches re-read on its return)",
            registry=registry,
        )


# The feed metrics on a registry (created once: prometheus refuses duplicates).
feed_metrics = PerRegistry(FeedMetrics)


class KvFeed:
    """Event-plane and ``kv_dump`` plumbing for the ``KvRouter``s of one process."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        config: KvRouterConfig,
        *,
        sync_component: str,
        resync_timeout_s: float = RESYNC_TIMEOUT_S,
    ) -> None:
        self._rt = runtime
        self.config = config
        self.sync_component = sync_component
        self._resync_timeout_s = resync_timeout_s
        self.metrics = feed_metrics(runtime.registry)
        self._routers: dict[str, KvRouter] = {}  # replica key -> router
        self._by_worker: dict[int, set[KvRouter]] = {}
        self._component_of: dict[int, str] = {}
        self._components: set[str] = set()
        self._dump_clients: dict[str, EndpointClient] = {}
        self._resyncing: set[int] = set()
        self._resync_again: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sync_pub: EventPublisher | None = None
        self._publishing: set[str] = set()
        self._events_down = False

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Joins replica sync when enabled. Routers added before or after are published. Follows
        the event plane's connection: while its server is away the routers route approximately,
        and when it is back every worker's cache is re-read."""
        if self._rt.events is not None and self.config.use_kv_events:
            self._rt.events.add_connection_listener(self._on_events_connection)
        if self.config.router_replica_sync:
            if self._rt.events is None:
                logger.warning("router replica sync disabled reason=no_event_plane")
            else:
                component = self._rt.namespace().component(self.sync_component)
                self._sync_pub = await component.publisher(TOPIC_ACTIVE_SEQUENCES)
                self._spawn(
                    self._follow(self.sync_component, TOPIC_ACTIVE_SEQUENCES, self._on_remote), "kv-replica-sync-in"
                )
                for key, kv in self._routers.items():
                    self._start_publishing(key, kv)
        logger.info(
            "kv feed started use_kv_events=%s replica_sync=%s sync_scope=%s/%s",
            self.config.use_kv_events,
            self._sync_pub is not None,
            self._rt.settings.namespace,
            self.sync_component,
        )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._sync_pub is not None:
            try:
                await self._sync_pub.close()
            except DynamoError as exc:
                logger.debug("kv feed close error=%s", exc)
            self._sync_pub = None
        for client in self._dump_clients.values():
            await client.close()
        self._dump_clients.clear()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("kv feed task failed task=%s error=%r", task.get_name(), task.exception())

    # -- routers and workers ----------------------------------------------------------------------

    def add_router(self, key: str, kv: KvRouter) -> None:
        """Registers a router under its replica key (the same key in every replica)."""
        self._routers[key] = kv
        self.metrics.routers.add(kv)
        if self._events_down:
            kv.enter_events_outage()
        if self._sync_pub is not None:
            self._start_publishing(key, kv)

    def add_worker(self, kv: KvRouter, worker_id: int, component: str) -> None:
        """``kv`` now tracks ``worker_id`` (of ``component``): its events and load reach ``kv``, and
        its cached blocks are read from ``kv_dump`` (it may have cached before we saw it)."""
        routers = self._by_worker.setdefault(worker_id, set())
        first = kv not in routers
        routers.add(kv)
        self._component_of[worker_id] = component
        if self._rt.events is not None and component not in self._components:
            self._components.add(component)
            self._spawn(self._follow(component, TOPIC_KV_EVENTS, self._on_kv_event), f"kv-events-in:{component}")
            self._spawn(self._follow(component, TOPIC_KV_METRICS, self._on_load), f"kv-load-in:{component}")
        if first and self.config.use_kv_events:
            kv.request_resync(worker_id)
            # A ZMQ subscription connects asynchronously after the publisher is discovered, and
            # events sent in that window are lost without a later event to reveal the gap. Read
            # the dump once more when the subscription has surely settled.
            self._spawn(self._resync_later(kv, worker_id), f"kv-resync-settle:{worker_id:x}")

    def remove_worker(self, kv: KvRouter, worker_id: int) -> None:
        """The worker left discovery for good: ``kv`` forgets it (index, load, active requests)."""
        routers = self._by_worker.get(worker_id)
        if routers is not None:
            routers.discard(kv)
            if not routers:
                del self._by_worker[worker_id]
                self._component_of.pop(worker_id, None)
        kv.remove_worker(worker_id)

    def _on_events_connection(self, connected: bool) -> None:
        self._events_down = not connected
        self.metrics.events_outage.set(0 if connected else 1)
        if not connected:
            self.metrics.events_outages.inc()
        for kv in self._routers.values():
            if connected:
                kv.leave_events_outage()
            else:
                kv.enter_events_outage()
        logger.info("kv feed event plane connected=%s routers=%d", connected, len(self._routers))

    # -- events in --------------------------------------------------------------------------------

    async def _follow(self, component_name: str, topic: str, apply: Callable[[bytes], None]) -> None:
        """Applies every message of ``topic`` from the component's publishers; resubscribes with
        capped backoff when the subscription fails or ends (missed KV events show up as gaps
        and are repaired from ``kv_dump``)."""
        component = self._rt.namespace().component(component_name)
        delay = SUBSCRIBE_RETRY_MIN_S
        while True:
            sub: EventSubscriber | None = None
            try:
                sub = await component.subscribe(topic)
                logger.info("kv feed subscribed component=%s topic=%s", component_name, topic)
                delay = SUBSCRIBE_RETRY_MIN_S
                async for msg in sub:
                    apply(msg.payload)
                logger.warning("kv feed subscription ended component=%s topic=%s action=resubscribe", component_name, topic)
            except (DynamoError, OSError, TimeoutError) as exc:
                logger.warning(
                    "kv feed subscription failed component=%s topic=%s error=%s retry_in_s=%.1f",
                    component_name, topic, exc, delay,
                )
            finally:
                if sub is not None:
                    with contextlib.suppress(DynamoError):
                        await sub.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, SUBSCRIBE_RETRY_MAX_S)

    def _on_kv_event(self, payload: bytes) -> None:
        try:
            ev = router_event_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed kv event error=%s", exc)
            return
        for kv in self._by_worker.get(ev.worker_id, ()):
            kv.apply_event(ev)

    def _on_load(self, payload: bytes) -> None:
        try:
            m = load_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed load metrics error=%s", exc)
            return
        for kv in self._by_worker.get(m.worker_id, ()):
            kv.apply_load(m)

    # -- resync from kv_dump ----------------------------------------------------------------------

    async def _resync_later(self, kv: KvRouter, worker_id: int) -> None:
        await asyncio.sleep(SUBSCRIPTION_SETTLE_S)
        if kv in self._by_worker.get(worker_id, ()):
            kv.request_resync(worker_id)

    def request_resync(self, worker_id: int) -> None:
        """``KvRouter``'s ``on_resync``: fetch the worker's ``kv_dump`` for every router tracking it.
        A request while a fetch is running fetches again afterwards (the running dump may predate
        the gap that caused this request)."""
        if worker_id in self._resyncing:
            self._resync_again.add(worker_id)
            return
        self._resyncing.add(worker_id)
        self._spawn(self._resync(worker_id), f"kv-resync:{worker_id:x}")

    async def _resync(self, worker_id: int) -> None:
        """Fetches until a dump is applied (a failed fetch is retried with backoff: until then the
        routers keep the worker flagged and buffer its events) or the worker is gone."""
        delay = RESYNC_RETRY_MIN_S
        try:
            while worker_id in self._by_worker:
                self._resync_again.discard(worker_id)
                if await self._resync_once(worker_id):
                    if worker_id not in self._resync_again:
                        return
                    continue
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESYNC_RETRY_MAX_S)
        finally:
            self._resyncing.discard(worker_id)
            self._resync_again.discard(worker_id)

    async def _resync_once(self, worker_id: int) -> bool:
        """One ``kv_dump`` fetch applied to every router tracking the worker; False if it failed."""
        component = self._component_of.get(worker_id)
        if component is None or not self._by_worker.get(worker_id):
            return True
        try:
            client = await self._dump_client(component)
            await client.instance_set.wait_for(
                lambda insts: any(i.instance_id == worker_id for i in insts), RESYNC_WAIT_INSTANCE_S
            )
            frames = await client.call({}, instance_id=worker_id, timeout_s=self._resync_timeout_s)
            events = [msgspec.convert(e, RouterEvent) for f in frames for e in (f.get("events") or [])]
        except (DynamoError, TimeoutError, msgspec.ValidationError) as exc:
            self.metrics.resyncs.labels("failed").inc()
            logger.warning("kv resync failed worker_id=%016x component=%s error=%s", worker_id, component, exc)
            return False
        for kv in list(self._by_worker.get(worker_id, ())):
            if kv.needs_resync(worker_id):  # the others are in step; a dump could only set them back
                kv.replace_worker_blocks(worker_id, events)  # the dump's last event id read from its stamps
        self.metrics.resyncs.labels("ok").inc()
        return True

    async def _dump_client(self, component: str) -> EndpointClient:
        client = self._dump_clients.get(component)
        if client is None:
            client = await self._rt.namespace().component(component).endpoint(control.KV_DUMP).client()
            self._dump_clients[component] = client
        return client

    # -- replica sync -----------------------------------------------------------------------------

    def _start_publishing(self, key: str, kv: KvRouter) -> None:
        if key not in self._publishing:
            self._publishing.add(key)
            self._spawn(self._publish_sync(key, kv), f"kv-replica-sync-out:{key}")

    async def _publish_sync(self, key: str, kv: KvRouter) -> None:
        pub = self._sync_pub
        assert pub is not None
        while True:
            events = await kv.next_sync_events()
            envelope = SyncEnvelope(model=key, events=[encode_sequence_event(e) for e in events])
            try:
                await pub.publish(TOPIC_ACTIVE_SEQUENCES, sync_envelope_encoder.encode(envelope))
            except DynamoError as exc:
                # Replicas then undercount this router's load until its requests end: degraded, not broken.
                logger.warning("replica sync publish failed key=%s events=%d error=%s", key, len(events), exc)
                continue
            self.metrics.sync_published.inc(len(events))

    def _on_remote(self, payload: bytes) -> None:
        try:
            envelope = sync_envelope_decoder.decode(payload)
            kv = self._routers.get(envelope.model)
            if kv is None:
                return
            applied = 0
            for raw in envelope.events:
                ev = decode_sequence_event(raw)
                if ev.router_id == kv.router_id:
                    continue  # our own changes come back to us on the shared topic
                kv.apply_remote(ev)
                applied += 1
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed replica sync message error=%s", exc)
            return
        if applied:
            self.metrics.sync_applied.inc(applied)
