"""Worker health shared between frontends over the event plane.

Several frontends (``--num-frontends N`` on one port, or separate hosts) route to the same
workers. When one of them finds a worker unreachable, every frontend quarantines it, so no peer
walks into the dead worker while its discovery record waits for the lease to expire. (The KV
router's own state, its active sequences, travels separately: see ``kv_routing.py``.)

Notices travel on ``namespace/frontend/frontend_worker_health`` as msgpack ``RoutingNotice``s
(``shared/protocol/worker_health.py``); a frontend ignores its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec

from dynamod.daemon.frontend.pipeline.routing import Quarantine
from dynamod.shared.errors import DynamoError
from dynamod.shared.events.plane import EventPublisher, EventSubscriber
from dynamod.shared.protocol.worker_health import (
    KIND_WORKER_DOWN,
    TOPIC_WORKER_HEALTH,
    RoutingNotice,
    routing_notice_decoder,
    routing_notice_encoder,
)

if TYPE_CHECKING:
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

FRONTEND_COMPONENT = "frontend"


class RoutingSync:
    def __init__(self, runtime: DistributedRuntime, quarantine: Quarantine) -> None:
        self._rt = runtime
        self._quarantine = quarantine
        self._me = runtime.instance_id
        self._pub: EventPublisher | None = None
        self._sub: EventSubscriber | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self._rt.events is None:
            return
        component = self._rt.namespace().component(FRONTEND_COMPONENT)
        try:
            self._pub = await component.publisher(TOPIC_WORKER_HEALTH)
            self._sub = await component.subscribe(TOPIC_WORKER_HEALTH)
        except DynamoError as exc:
            logger.warning("routing sync disabled error=%s", exc)
            return
        self._task = asyncio.create_task(self._listen(), name="frontend-routing-sync")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for closable in (self._sub, self._pub):
            if closable is not None:
                try:
                    await closable.close()
                except DynamoError as exc:
                    logger.debug("routing sync close error=%s", exc)

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, notice: RoutingNotice) -> None:
        """Fire and forget: the event plane's publisher never blocks for long."""
        pub = self._pub
        if pub is None:
            return
        task = asyncio.get_running_loop().create_task(pub.publish(TOPIC_WORKER_HEALTH, routing_notice_encoder.encode(notice)))
        self._pending.add(task)
        task.add_done_callback(self._published)

    def _published(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("routing notice not sent error=%s", task.exception())

    def publish_worker_down(self, worker_id: int) -> None:
        self.publish(RoutingNotice(sender=self._me, kind=KIND_WORKER_DOWN, worker_id=worker_id))

    # -- receiving ------------------------------------------------------------------------------

    async def _listen(self) -> None:
        assert self._sub is not None
        async for msg in self._sub:
            try:
                notice = routing_notice_decoder.decode(msg.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("ignoring malformed routing notice error=%s", exc)
                continue
            if notice.sender == self._me:
                continue
            if notice.kind == KIND_WORKER_DOWN and notice.worker_id not in self._quarantine:
                self._quarantine.add(notice.worker_id)
                logger.info("worker reported unreachable by peer worker_id=%016x peer=%016x", notice.worker_id, notice.sender)
