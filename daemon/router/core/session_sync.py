"""Shares session bindings between router replicas over the event plane.

Each ``SessionTable`` (one per served model) queues the bindings its router makes; this publishes
them on ``{namespace}/{component}/session_affinity_events`` as ``SessionEnvelope``s keyed by the
model name, and applies the other replicas' envelopes to the table of the same key. The frontend
runs one in every router mode (sessions are kept in round-robin and random too, where no KV feed
runs); it starts when the process has an event plane and sessions are enabled.

Delivery is best effort, as for the active-sequence changes: a lost message only means a replica
routes that session's next request by its mode and binds it there, and the conflict is settled by
the tables' ordering (``SessionTable.apply_remote``) when the bindings meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import msgspec

from dynamod.daemon.router.core.sessions import SessionTable
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.replica_sync import (
    TOPIC_SESSION_AFFINITY,
    SessionEnvelope,
    session_envelope_decoder,
    session_envelope_encoder,
)

if TYPE_CHECKING:
    from dynamod.shared.events.plane import EventPublisher, EventSubscriber
    from dynamod.shared.runtime.distributed import DistributedRuntime

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0


class SessionSync:
    def __init__(self, runtime: DistributedRuntime, component: str) -> None:
        self._rt = runtime
        self.component = component
        self._tables: dict[str, SessionTable] = {}
        self._pub: EventPublisher | None = None
        self._publishing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.published = 0
        self.applied = 0

    def add_table(self, key: str, table: SessionTable) -> None:
        self._tables[key] = table
        if self._pub is not None:
            self._start_publishing(key, table)

    async def start(self) -> None:
        if self._rt.events is None:
            logger.info("session sync off reason=no_event_plane")
            return
        component = self._rt.namespace().component(self.component)
        try:
            self._pub = await component.publisher(TOPIC_SESSION_AFFINITY)
        except DynamoError as exc:  # affinity still works within this process
            logger.warning("session sync off error=%s", exc)
            return
        self._spawn(self._follow(), "session-sync-in")
        for key, table in self._tables.items():
            self._start_publishing(key, table)
        logger.info("session sync started scope=%s/%s", self._rt.settings.namespace, self.component)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._pub is not None:
            with contextlib.suppress(DynamoError):
                await self._pub.close()
            self._pub = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_publishing(self, key: str, table: SessionTable) -> None:
        if key not in self._publishing:
            self._publishing.add(key)
            self._spawn(self._publish(key, table), f"session-sync-out:{key}")

    async def _publish(self, key: str, table: SessionTable) -> None:
        pub = self._pub
        assert pub is not None
        while True:
            bindings = await table.next_sync_events()
            payload = session_envelope_encoder.encode(SessionEnvelope(model=key, sessions=bindings))
            try:
                await pub.publish(TOPIC_SESSION_AFFINITY, payload)
            except DynamoError as exc:
                logger.warning("session sync publish failed key=%s bindings=%d error=%s", key, len(bindings), exc)
                continue
            self.published += len(bindings)

    def apply(self, payload: bytes) -> int:
        """Applies one envelope from the topic; returns the bindings that changed ours."""
        try:
            envelope = session_envelope_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed session sync message error=%s", exc)
            return 0
        table = self._tables.get(envelope.model)
        if table is None:
            return 0
        changed = sum(1 for ev in envelope.sessions if table.apply_remote(ev))
        self.applied += changed
        return changed

    async def _follow(self) -> None:
        component = self._rt.namespace().component(self.component)
        delay = RETRY_MIN_S
        while True:
            sub: EventSubscriber | None = None
            try:
                sub = await component.subscribe(TOPIC_SESSION_AFFINITY)
                delay = RETRY_MIN_S
                async for msg in sub:
                    self.apply(msg.payload)
                logger.warning("session sync subscription ended action=resubscribe")
            except (DynamoError, OSError, TimeoutError) as exc:
                logger.warning("session sync subscription failed error=%s retry_in_s=%.1f", exc, delay)
            finally:
                if sub is not None:
                    with contextlib.suppress(DynamoError):
                        await sub.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
