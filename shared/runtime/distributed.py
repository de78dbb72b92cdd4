"""``DistributedRuntime`` -> ``namespace`` -> ``component`` -> ``endpoint``: the process-wide runtime.

One runtime per process owns: the discovery store and the process lease (everything the process
registers lives under it, so a dead process vanishes within one TTL), the request-plane server
(started on first ``serve``) and client, the event plane, the component metrics and the optional
status server. ``shutdown()`` undoes all of it in the right order: mark the instances draining so
routers stop sending, let in-flight streams finish, only then deregister (a client fails its
streams to an instance the moment it leaves discovery), then close the planes and revoke the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.factory import default_file_kv_dir, make_store
from dynamod.shared.discovery.store import DiscoveryStore, Lease
from dynamod.shared.errors import DynamoError, error_to_wire
from dynamod.shared.events.factory import make_event_plane
from dynamod.shared.events.plane import EventPlane, EventPublisher, EventSubscriber
from dynamod.shared.observability.metrics import ComponentMetrics
from dynamod.shared.observability.process_metrics import register_process_metrics
from dynamod.shared.observability.status_server import QueryRoute, StatusServer
from dynamod.shared.protocol.instance import STATUS_DRAINING, STATUSES, Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key
from dynamod.shared.runtime.client import EndpointClient, endpoint_path
from dynamod.shared.runtime.retrying_write import DEFAULT_WAIT_S, RetryingWrite
from dynamod.shared.transport.factory import make_client, make_server
from dynamod.shared.transport.liveness import RequestPlaneMetrics
from dynamod.shared.transport.plane import (
    Handler,
    RequestContext,
    RequestPlaneClient,
    RequestPlaneServer,
    ServerAddress,
)

logger = logging.getLogger(__name__)


class DistributedRuntime:
    """Build with ``await DistributedRuntime.create(settings)``; end with ``await rt.shutdown()``."""

    def __init__(self, settings: RuntimeSettings, store: DiscoveryStore, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry or CollectorRegistry()
        self.metrics = ComponentMetrics(self.registry)
        self.lease: Lease | None = None
        self._instance_id = 0
        self.events: EventPlane | None = None
        self.request_plane_metrics = RequestPlaneMetrics(self.registry)  # shared by client and server
        self.request_client: RequestPlaneClient = make_client(
            nats_url=settings.nats_server,
            heartbeat=settings.request_plane_heartbeat,
            metrics=self.request_plane_metrics,
            security=settings.security.request_plane,
            nats_security=settings.security.nats,
        )
        self._server: RequestPlaneServer | None = None
        self._server_address: ServerAddress | None = None
        self._server_lock = asyncio.Lock()
        self._served: list[ServedInstance] = []
        self._status: StatusServer | None = None
        self._stopping = False
        self._closed = False
        self._extra_leases: list[Lease] = []
        self.ready_probe_extra: dict[str, Any] = {}

    @classmethod
    async def create(
        cls,
        settings: RuntimeSettings,
        *,
        store: DiscoveryStore | None = None,
        registry: CollectorRegistry | None = None,
        events: bool = True,
    ) -> DistributedRuntime:
        settings.validate()
        if store is None:
            file_root = settings.file_kv or default_file_kv_dir()
            store = make_store(
                settings.discovery_backend,
                etcd_endpoints=settings.etcd_endpoints,
                file_root=file_root,
                etcd_security=settings.security.etcd,
            )
        rt = cls(settings, store, registry)
        register_process_metrics(rt.registry, asyncio.get_running_loop())
        try:
            await store.start()
            rt.lease = await store.create_lease(settings.lease_ttl_s)
            # Fixed at creation: keys already registered keep this id even if a backend had to
            # re-grant the lease under another id after an outage.
            rt._instance_id = rt.lease.id
            if events:
                rt.events = make_event_plane(
                    settings.event_plane,
                    nats_url=settings.nats_server,
                    store=store,
                    lease=rt.lease,
                    host=settings.host,  # ZMQ publishers bind here and advertise an address peers can dial
                    advertise_host=settings.advertised(settings.host),
                    nats_security=settings.security.nats,
                    membership=settings.security.request_plane,  # the token turns on ZMQ CURVE
                )
                await rt.events.start()
            if settings.system_port is not None:
                rt._status = StatusServer(
                    rt.registry,
                    rt._health,
                    host=settings.system_host,
                    port=settings.system_port,
                    advertise_host=settings.advertised(settings.system_host),
                    token=settings.security.request_plane.token,  # /health details for members only
                )
                await rt._status.start()
        except BaseException:
            # Half-built: release the lease, the planes and the store, so nothing keeps running
            # (or keeps a lease alive) behind the error the caller is about to report.
            await rt.shutdown(grace_s=0)
            raise
        logger.info(
            "runtime started instance_id=%016x discovery=%s request_plane=%s event_plane=%s namespace=%s",
            rt.lease.id,
            settings.discovery_backend,
            settings.request_plane,
            settings.event_plane if events else "off",
            settings.namespace,
        )
        return rt

    # -- identity ---------------------------------------------------------------------------

    @property
    def instance_id(self) -> int:
        assert self.lease is not None, "runtime not started"
        return self._instance_id

    @property
    def status_url(self) -> str:
        return self._status.url if self._status else ""

    def add_status_route(self, path: str, handler: QueryRoute) -> bool:
        """Serves ``GET path`` on this process's status server, guarded like its ``/metrics``
        (``StatusServer.add_route``); False when there is no status server."""
        if self._status is None:
            return False
        self._status.add_route(path, handler)
        return True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def namespace(self, name: str | None = None) -> Namespace:
        return Namespace(self, name or self.settings.namespace)

    async def create_lease(self) -> Lease:
        """An extra lease for a second instance in this process (``--num-workers``)."""
        lease = await self.store.create_lease(self.settings.lease_ttl_s)
        self._extra_leases.append(lease)
        return lease

    # -- request plane server -----------------------------------------------------------------

    async def _ensure_server(self) -> tuple[RequestPlaneServer, ServerAddress]:
        async with self._server_lock:
            if self._server is None or self._server_address is None:
                server = make_server(
                    self.settings.request_plane,
                    host=self.settings.host,
                    port=self.settings.request_plane_port,
                    advertise_host=self.settings.advertised(self.settings.host),
                    nats_url=self.settings.nats_server,
                    security=self.settings.security.request_plane,
                    nats_security=self.settings.security.nats,
                    metrics=self.request_plane_metrics,
                    limits=self.settings.request_plane_limits,
                )
                self._server_address = await server.start()
                self._server = server
                logger.info("request plane serving transport=%s address=%s", self._server_address.transport, self._server_address.address)
                problem = self.settings.loopback_advertise_problem()  # the one place a server's address is chosen
                if problem:
                    logger.warning("request plane unreachable from other hosts address=%s reason=%s",
                                   self._server_address.address, problem)
            return self._server, self._server_address

    @property
    def inflight(self) -> int:
        return self._server.inflight if self._server else 0

    # -- health -------------------------------------------------------------------------------

    def _health(self) -> tuple[bool, dict]:
        endpoints = [
            {"endpoint": s.path, "instance_id": f"{s.instance_id:x}", "status": s.record.status}
            for s in self._served
            if s.registered
        ]
        ready = bool(endpoints) and not self._stopping
        return ready, {"endpoints": endpoints, "inflight": self.inflight, **self.ready_probe_extra}

    # -- shutdown -----------------------------------------------------------------------------

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Marks instances draining, drains in-flight streams up to ``grace_s``, deregisters,
        closes planes, revokes leases. Draining before deleting: clients fail their streams to an
        instance the moment its record goes, so deleting first would migrate every stream that
        was about to finish here."""
        if self._closed:
            return
        self._stopping = True
        logger.info("runtime stopping served=%d inflight=%d grace_s=%.1f", len(self._served), self.inflight, grace_s)
        served_all = list(self._served)
        await mark_all_draining(served_all)
        if self._server:
            await self._server.stop(grace_s)
        await deregister_all(served_all)
        await self.request_client.close()
        if self.events:
            await self.events.close()
        if self._status:
            await self._status.stop()
        for lease in [*self._extra_leases, self.lease]:
            if lease is not None:
                try:
                    await lease.revoke()
                except DynamoError as exc:
                    logger.warning("lease revoke failed lease=%016x error=%s", lease.id, exc)
        await self.store.close()
        self._closed = True
        logger.info("runtime stopped")


async def mark_all_draining(served: Iterable[ServedInstance]) -> None:
    """First step of a graceful stop: every record says ``draining`` (routers stop sending new
    work) while it stays registered, so streams in flight finish instead of failing over (clients
    fail streams to an instance the moment its record goes). A record that cannot be written is
    logged and skipped: stopping goes on, the lease ends it anyway. In parallel, so that with
    discovery away the per-write timeouts do not add up."""

    async def one(s: ServedInstance) -> None:
        await s.cancel_pending_write()
        try:
            await s.set_status(STATUS_DRAINING)
        except DynamoError as exc:
            logger.warning("draining status not published endpoint=%s error=%s", s.path, exc)

    await asyncio.gather(*(one(s) for s in served))


async def deregister_all(served: Iterable[ServedInstance]) -> None:
    """Last step of a graceful stop, once the streams finished: the records go, in parallel."""

    async def one(s: ServedInstance) -> None:
        try:
            await s.deregister()
        except DynamoError as exc:
            logger.warning("deregister failed endpoint=%s error=%s", s.path, exc)

    await asyncio.gather(*(one(s) for s in served))


class Namespace:
    def __init__(self, runtime: DistributedRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> Component:
        return Component(self, name)


class Component:
    def __init__(self, namespace: Namespace, name: str) -> None:
        self.namespace = namespace
        self.runtime = namespace.runtime
        self.name = name

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(self, name)

    async def publisher(self, topic: str) -> EventPublisher:
        if self.runtime.events is None:
            raise DynamoError("this runtime was created without an event plane")
        return await self.runtime.events.publisher(self.namespace.name, self.name, topic)

    async def subscribe(self, topic: str) -> EventSubscriber:
        if self.runtime.events is None:
            raise DynamoError("this runtime was created without an event plane")
        return await self.runtime.events.subscribe(self.namespace.name, self.name, topic)


class Endpoint:
    def __init__(self, component: Component, name: str) -> None:
        self.component = component
        self.runtime = component.runtime
        self.name = name

    @property
    def namespace_name(self) -> str:
        return self.component.namespace.name

    async def serve(
        self,
        handler: Handler,
        *,
        lease: Lease | None = None,
        role: str = "",
        model: str = "",
        labels: dict[str, str] | None = None,
        status: str = "ready",
    ) -> ServedInstance:
        """Registers an instance of this endpoint that answers with ``handler``."""
        rt = self.runtime
        server, address = await rt._ensure_server()
        lease = lease or rt.lease
        assert lease is not None
        record = Instance(
            namespace=self.namespace_name,
            component=self.component.name,
            endpoint=self.name,
            instance_id=lease.id,
            transport=address.transport,
            address=address.address,
            node=rt.settings.node_name,
            pid=os.getpid(),
            role=role,
            status=status,
            model=model,
            labels=dict(labels or {}),
            started_at=time.time(),
            system_url=rt.status_url,
        )
        served = ServedInstance(self, record, lease, server)
        server.register(served.path, served.wrap(handler))
        await served.publish()
        rt._served.append(served)
        logger.info(
            "endpoint served path=%s instance_id=%016x transport=%s address=%s",
            served.path,
            record.instance_id,
            address.transport,
            address.address,
        )
        return served

    async def advertise(
        self, *, transport: str, address: str, role: str = "", labels: dict[str, str] | None = None
    ) -> ServedInstance:
        """Registers an instance served outside the request plane (the frontend's HTTP server), so
        operators and tools find it in discovery like any other; it lives and dies with the lease."""
        rt = self.runtime
        assert rt.lease is not None
        record = Instance(
            namespace=self.namespace_name,
            component=self.component.name,
            endpoint=self.name,
            instance_id=rt.instance_id,
            transport=transport,
            address=address,
            node=rt.settings.node_name,
            pid=os.getpid(),
            role=role,
            labels=dict(labels or {}),
            started_at=time.time(),
            system_url=rt.status_url,
        )
        served = ServedInstance(self, record, rt.lease, None)
        await served.publish()
        rt._served.append(served)
        logger.info("instance advertised path=%s transport=%s address=%s", served.path, transport, address)
        return served

    async def client(self) -> EndpointClient:
        rt = self.runtime
        return await EndpointClient(
            rt.store, rt.request_client, self.namespace_name, self.component.name, self.name
        ).start()


class ServedInstance:
    """One registered instance: its discovery record, its handler on the server, its metrics."""

    def __init__(self, endpoint: Endpoint, record: Instance, lease: Lease, server: RequestPlaneServer | None) -> None:
        self.endpoint = endpoint
        self.record = record
        self.lease = lease
        self._server = server
        self.path = endpoint_path(record.namespace, record.component, record.endpoint, record.instance_id)
        self.key = instance_key(record.namespace, record.component, record.endpoint, record.instance_id)
        self.registered = False
        self.inflight = 0
        # An operator's status change not yet written: retried until discovery takes it.
        self._writes: RetryingWrite[Instance] = RetryingWrite(f"instance {self.path}", self._write_record)

    @property
    def instance_id(self) -> int:
        return self.record.instance_id

    @property
    def write_pending(self) -> bool:
        """A status change was accepted while discovery was unreachable and is not written yet."""
        return self._writes.pending

    async def publish(self, record: Instance | None = None) -> None:
        """Writes ``record`` (default: the current one) and adopts it only once the write
        succeeded, so after a failed write the record still differs and a retry writes again."""
        record = record or self.record
        await self.endpoint.runtime.store.put(self.key, encode_instance(record), self.lease)
        self.record = record
        self.registered = True

    async def set_status(self, status: str) -> None:
        """Writes the new status; adopted only once written (raises on a failed write, and a
        retry writes again). Supersedes a deferred write of another status."""
        if status not in STATUSES:
            raise ValueError(f"unknown instance status {status!r}")
        if self._writes.pending:
            await self._writes.close()  # the newer wish wins; no late retry may overwrite it
        if self.record.status != status:
            await self._update(msgspec.structs.replace(self.record, status=status))
            logger.info("instance status path=%s status=%s", self.path, status)

    async def set_status_eventually(self, status: str, *, wait_s: float = DEFAULT_WAIT_S) -> bool:
        """Like ``set_status``, for an operator's action that a discovery outage must not lose
        (a drain during an etcd restart): the write is retried in the background until it lands
        (``record`` adopted then), and the caller waits at most ``wait_s``. Returns True when it
        was written in that time, False while it is pending. A later call supersedes it."""
        if status not in STATUSES:
            raise ValueError(f"unknown instance status {status!r}")
        if not self.registered:
            await self.set_status(status)
            return True
        if self.record.status == status and not self._writes.pending:
            return True
        written = await self._writes.submit(msgspec.structs.replace(self.record, status=status), wait_s=wait_s)
        if written:
            logger.info("instance status path=%s status=%s", self.path, status)
        return written

    async def _write_record(self, record: Instance) -> None:
        # The record may have changed since it was submitted (labels): keep those, take the status.
        await self.publish(msgspec.structs.replace(self.record, status=record.status))

    async def cancel_pending_write(self) -> None:
        """Stops retrying a deferred write (shutdown: the record is about to be deleted)."""
        await self._writes.close()

    async def update_labels(self, **labels: str) -> None:
        await self._update(msgspec.structs.replace(self.record, labels={**self.record.labels, **labels}))

    async def _update(self, record: Instance) -> None:
        if self.registered:
            await self.publish(record)
        else:
            self.record = record

    async def deregister(self) -> None:
        """Removes the discovery record (routers stop sending) but keeps serving in-flight streams.
        Marked unregistered only once the delete succeeded, so a failed one can be retried."""
        if self.registered:
            await self.endpoint.runtime.store.delete(self.key)
            self.registered = False
            logger.info("endpoint deregistered path=%s", self.path)

    def stop_serving(self) -> None:
        if self._server is not None:
            self._server.unregister(self.path)

    def wrap(self, handler: Handler) -> Handler:
        """Adds metrics and error accounting around a handler without changing its stream.
        (Only request-plane handlers get ``dynamo_component_*`` series: an advertised instance,
        such as the frontend's HTTP server, exports its own metrics.)"""
        labels = (self.record.namespace, self.record.component, self.record.endpoint)
        metrics = self.endpoint.runtime.metrics
        self._m_requests = metrics.requests.labels(*labels)
        self._m_duration = metrics.duration.labels(*labels)
        self._m_inflight = metrics.inflight.labels(*labels)
        self._m_errors = metrics.errors
        self._labels = labels

        async def instrumented(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            self._m_requests.inc()
            self._m_inflight.inc()
            self.inflight += 1
            try:
                # aclosing: a cancelled caller closes the handler now, so its cleanup (aborting the
                # engine request) runs at once rather than whenever the generator is collected.
                async with contextlib.aclosing(handler(body, ctx)) as stream:
                    async for item in stream:
                        yield item
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except BaseException as exc:
                wire = error_to_wire(exc)
                self._m_errors.labels(*self._labels, str(wire["code"])).inc()
                if not isinstance(exc, DynamoError):
                    logger.exception("handler failed path=%s request_id=%s", self.path, ctx.request_id)
                raise
            finally:
                self.inflight -= 1
                self._m_inflight.dec()
                self._m_duration.observe(time.perf_counter() - start)

        return instrumented
