"""Event-plane collector: load metrics, KV events, router and planner decisions, per namespace.

One subscription per (namespace, topic) with component ``*``. A subscription that fails is retried
with capped backoff and the failure is shown as the ``events`` connection state, so a NATS outage
is visible in the console and heals without a restart.

Every topic is decoded with its wire type's decoder (load, KV events, router and planner
decisions), so a renamed field fails here as a decode error instead of showing as blanks.
"""

from __future__ import annotations

import asyncio
import logging
import random

import msgspec

from dynamod.console.state.decisions import decode_router_decision
from dynamod.console.state.recording import StateSink
from dynamod.shared.errors import DynamoError
from dynamod.shared.events.plane import (
    TOPIC_KV_EVENTS,
    TOPIC_KV_METRICS,
    TOPIC_PLANNER_DECISIONS,
    TOPIC_ROUTER_DECISIONS,
    EventMessage,
    EventPlane,
)
from dynamod.shared.protocol.kv_events import router_event_decoder
from dynamod.shared.protocol.load import load_decoder
from dynamod.shared.protocol.planner import decision_decoder

logger = logging.getLogger(__name__)

TOPICS = (TOPIC_KV_METRICS, TOPIC_KV_EVENTS, TOPIC_ROUTER_DECISIONS, TOPIC_PLANNER_DECISIONS)
_RETRY_MIN_S = 0.2


class EventCollector:
    def __init__(self, plane: EventPlane, sink: StateSink, *, topics: tuple[str, ...] = TOPICS, retry_max_s: float = 5.0) -> None:
        self._plane = plane
        self._sink = sink
        self._topics = topics
        self._retry_max_s = retry_max_s
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failing: set[tuple[str, str]] = set()
        self.received = 0

    @property
    def namespaces(self) -> list[str]:
        return sorted({ns for ns, _ in self._tasks})

    def ensure_namespace(self, namespace: str) -> None:
        """Subscribes to every topic of ``namespace`` unless already subscribed."""
        for topic in self._topics:
            key = (namespace, topic)
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(self._run(namespace, topic), name=f"console-sub:{namespace}:{topic}")

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def _run(self, namespace: str, topic: str) -> None:
        delay = _RETRY_MIN_S
        key = (namespace, topic)
        while True:
            sub = None
            try:
                sub = await self._plane.subscribe(namespace, "*", topic)
                if key in self._failing:
                    self._failing.discard(key)
                    if not self._failing:
                        self._sink.set_connection("events", "ok", detail="subscriptions restored")
                logger.info("console subscribed namespace=%s topic=%s", namespace, topic)
                delay = _RETRY_MIN_S
                async for msg in sub:
                    self._handle(namespace, topic, msg)
                logger.warning("console subscription ended namespace=%s topic=%s; resubscribing", namespace, topic)
            except asyncio.CancelledError:
                raise
            except (DynamoError, OSError, ConnectionError, TimeoutError) as exc:
                self._failing.add(key)
                self._sink.set_connection("events", "lost", detail=f"{topic}: {exc}")
                logger.warning("console subscription failed namespace=%s topic=%s error=%s", namespace, topic, exc)
            finally:
                if sub is not None:
                    try:
                        await sub.close()
                    except (DynamoError, OSError):
                        pass
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self._retry_max_s)

    def _handle(self, namespace: str, topic: str, msg: EventMessage) -> None:
        self.received += 1
        try:
            if topic == TOPIC_KV_METRICS:
                self._sink.apply_load(load_decoder.decode(msg.payload))
            elif topic == TOPIC_KV_EVENTS:
                self._sink.apply_kv_event(router_event_decoder.decode(msg.payload))
            elif topic == TOPIC_ROUTER_DECISIONS:
                self._sink.apply_router_decision(namespace, decode_router_decision(msg.payload))
            elif topic == TOPIC_PLANNER_DECISIONS:
                self._sink.apply_planner_decision(namespace, decision_decoder.decode(msg.payload))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, UnicodeDecodeError) as exc:
            self._sink.note_decode_error(topic, str(exc))
