"""Clients of one endpoint: pick an instance (round-robin, random, direct) and stream a request.

The instance list comes from a discovery watch (``InstanceSet``); only instances with status
``ready`` get routed work, while ``direct`` reaches any live instance (control endpoints must reach
a draining or sleeping worker).

A stream is remembered (weakly) under the instance it went to, and when that instance leaves
discovery (its record deleted, its lease ended: not a status change) every stream still open to it
fails at once with ``InstanceGoneError``, a ``TransportError`` the frontend migrates. Without this a
stream to a process whose lease expired would wait for the connection to break, which for a frozen
or partitioned process is the heartbeat timeout at best. A graceful stop keeps its records
(``draining``) until its streams finished, so it causes no failover.
"""

from __future__ import annotations

import itertools
import logging
import random
import weakref
from collections.abc import AsyncIterator
from typing import Any

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import NoInstancesError, TransportError
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import instances_prefix
from dynamod.shared.runtime.instances import InstanceSet
from dynamod.shared.transport.plane import RequestPlaneClient, ServerAddress

logger = logging.getLogger(__name__)

ROUTE_ROUND_ROBIN = "round-robin"
ROUTE_RANDOM = "random"
ROUTE_DIRECT = "direct"


class InstanceGoneError(TransportError):
    """The instance serving a stream left discovery while the stream was open. Migratable like
    any lost connection, but no sign that the instance is unreachable: it is simply not there."""

    code = "instance_gone"


def endpoint_path(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """The name a served instance has on its request-plane server."""
    return f"{namespace}/{component}/{endpoint}/{instance_id:x}"


class EndpointClient:
    """Built by ``Endpoint.client()`` from the runtime's discovery store and request-plane client
    (the two pieces it uses, so it does not depend on the runtime that makes it)."""

    def __init__(
        self, store: DiscoveryStore, request_client: RequestPlaneClient, namespace: str, component: str, endpoint: str
    ) -> None:
        self._request_client = request_client
        self.namespace = namespace
        self.component = component
        self.endpoint = endpoint
        self.instance_set = InstanceSet(store, instances_prefix(namespace, component, endpoint))
        self.instance_set.add_gone_listener(self._instance_gone)
        self._rr = itertools.count()
        # Open streams by instance id, held weakly: a finished stream its caller dropped goes by itself.
        self._streams: dict[int, weakref.WeakSet[Any]] = {}

    async def start(self) -> EndpointClient:
        await self.instance_set.start()
        return self

    async def close(self) -> None:
        await self.instance_set.close()

    @property
    def instances(self) -> list[Instance]:
        """Every live instance, whatever its status, sorted by id."""
        return sorted(self.instance_set.instances, key=lambda i: i.instance_id)

    @property
    def routable(self) -> list[Instance]:
        return [i for i in self.instances if i.routable]

    async def wait_for_instances(self, count: int = 1, timeout: float = 10.0, *, routable: bool = True) -> list[Instance]:
        def enough(insts: list[Instance]) -> bool:
            return sum(1 for i in insts if i.routable or not routable) >= count

        await self.instance_set.wait_for(enough, timeout)
        return self.routable if routable else self.instances

    def pick(self, mode: str = ROUTE_ROUND_ROBIN, instance_id: int | None = None) -> Instance:
        if mode == ROUTE_DIRECT or instance_id is not None:
            if instance_id is None:
                raise NoInstancesError("direct routing needs an instance id")
            inst = self.instance_set.get(instance_id)
            if inst is None:
                raise NoInstancesError(
                    f"instance {instance_id:x} of {self.namespace}/{self.component}/{self.endpoint} is not registered"
                )
            return inst
        candidates = self.routable
        if not candidates:
            raise NoInstancesError(f"no ready instance serves {self.namespace}/{self.component}/{self.endpoint}")
        if mode == ROUTE_RANDOM:
            return random.choice(candidates)
        return candidates[next(self._rr) % len(candidates)]

    def stream_to(
        self,
        instance: Instance,
        body: Any,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Any]:
        """Streams one request to a chosen instance; it fails with InstanceGoneError if the
        instance leaves discovery before the stream ends."""
        stream = self._request_client.stream(
            ServerAddress(instance.transport, instance.address),
            endpoint_path(self.namespace, self.component, self.endpoint, instance.instance_id),
            body,
            headers=headers,
            timeout_s=timeout_s,
            request_id=request_id,
        )
        if hasattr(stream, "fail"):  # every transport's ClientStream; not the unknown-transport stub
            streams = self._streams.get(instance.instance_id)
            if streams is None:
                streams = self._streams[instance.instance_id] = weakref.WeakSet()
            streams.add(stream)
        return stream

    def _instance_gone(self, instance: Instance) -> None:
        streams = self._streams.pop(instance.instance_id, None)
        if not streams:
            return
        message = (
            f"instance {instance.instance_id:x} of {self.namespace}/{self.component}/{self.endpoint} "
            "left discovery (lease ended or record deleted) while the stream was open"
        )
        # One exception per stream: each reader's task raises (and adds a traceback to) its own.
        failed = sum(1 for stream in list(streams) if stream.fail(InstanceGoneError(message)))
        if failed:
            logger.warning(
                "instance left discovery with streams open path=%s/%s/%s instance_id=%016x streams=%d action=fail_over",
                self.namespace,
                self.component,
                self.endpoint,
                instance.instance_id,
                failed,
            )

    def generate(
        self,
        body: Any,
        *,
        mode: str = ROUTE_ROUND_ROBIN,
        instance_id: int | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Any]:
        """Picks an instance by ``mode`` and streams the request to it."""
        return self.stream_to(
            self.pick(mode, instance_id), body, headers=headers, timeout_s=timeout_s, request_id=request_id
        )

    async def call(self, body: Any, *, instance_id: int | None = None, timeout_s: float | None = 30.0) -> list[Any]:
        """Sends a request and collects the whole response stream (for control endpoints)."""
        mode = ROUTE_DIRECT if instance_id is not None else ROUTE_ROUND_ROBIN
        return [item async for item in self.generate(body, mode=mode, instance_id=instance_id, timeout_s=timeout_s)]
