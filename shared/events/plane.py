"""The event plane's narrow interface: fire-and-forget pub/sub scoped by namespace and component.

Two implementations: NATS (core subjects ``namespace.{ns}.component.{component}.{topic}``; JetStream
where durability is asked for) and ZMQ (each publisher binds a PUB socket on loopback and registers
it under ``v1/event_channels/{ns}/{component}/{topic}/{instance_id:x}``; subscribers watch that
prefix and connect to every publisher). Payloads are bytes (msgpack-encoded wire structs); ZMQ
frames are ``[topic, seq u64 big-endian, payload]`` so a subscriber can detect gaps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# Topic names from DESIGN.md.
TOPIC_KV_EVENTS = "kv-events"
TOPIC_KV_METRICS = "kv_metrics"
TOPIC_ACTIVE_SEQUENCES = "active_sequences_events"
TOPIC_ROUTER_DECISIONS = "router_decisions"
TOPIC_PLANNER_DECISIONS = "planner_decisions"


def nats_subject(namespace: str, component: str, topic: str) -> str:
    """NATS subject for a scoped topic. Dots inside names are replaced so scoping stays exact."""

    def clean(part: str) -> str:
        return part.replace(".", "_").replace("*", "_").replace(">", "_").replace(" ", "_")

    return f"namespace.{clean(namespace)}.component.{clean(component)}.{clean(topic)}"


@dataclass(frozen=True, slots=True)
class EventMessage:
    topic: str
    payload: bytes
    publisher_id: int = 0  # instance id of the publisher when known (ZMQ), else 0
    seq: int = 0  # per-publisher sequence number when known (ZMQ), else 0


@runtime_checkable
class EventPublisher(Protocol):
    async def publish(self, topic: str, payload: bytes) -> None:
        """Sends without waiting for subscribers; never blocks the caller for long (bounded queue,
        oldest messages dropped with a counter when a transport is slow)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class EventSubscriber(Protocol):
    def __aiter__(self) -> AsyncIterator[EventMessage]: ...

    async def close(self) -> None: ...


ConnectionListener = Callable[[bool], None]


@runtime_checkable
class EventPlane(Protocol):
    """Factory for publishers/subscribers bound to one process (its discovery store and lease)."""

    name: str  # "nats" | "zmq"

    async def start(self) -> None: ...

    async def publisher(self, namespace: str, component: str, topic: str) -> EventPublisher: ...

    async def subscribe(self, namespace: str, component: str, topic: str) -> EventSubscriber:
        """Subscribes to ``topic`` from every publisher of ``namespace/component``. ``component``
        may be ``"*"`` for every component of the namespace."""
        ...

    def add_connection_listener(self, listener: ConnectionListener) -> None:
        """``listener(False)`` when the plane loses its server (events published meanwhile are
        lost to subscribers), ``listener(True)`` when it is back. A brokerless plane (ZMQ: each
        publisher is its own server) never calls it: a lost publisher shows as a sequence gap."""
        ...

    async def close(self) -> None: ...
