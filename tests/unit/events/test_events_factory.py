"""Choosing the event plane by name, and the NATS subject/stream names it relies on."""

from __future__ import annotations

import pytest

from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import ConfigError, InvalidRequestError
from dynamod.shared.events.factory import make_event_plane
from dynamod.shared.events.nats_plane import NatsEventPlane
from dynamod.shared.events.nats_subjects import consumer_name, scope_subject, stream_name, stream_subject
from dynamod.shared.events.plane import EventPlane, nats_subject
from dynamod.shared.events.zmq_plane import ZmqEventPlane


async def test_nats_needs_a_url() -> None:
    with pytest.raises(ConfigError, match="NATS_SERVER"):
        make_event_plane("nats")
    plane = make_event_plane("nats", nats_url="nats://127.0.0.1:4222")
    assert isinstance(plane, NatsEventPlane) and isinstance(plane, EventPlane)
    assert plane.url == "nats://127.0.0.1:4222"


async def test_zmq_needs_store_and_lease() -> None:
    store = MemStore()
    await store.start()
    with pytest.raises(ConfigError, match="a discovery store and a lease"):
        make_event_plane("zmq")
    with pytest.raises(ConfigError, match="a lease"):
        make_event_plane("zmq", store=store)
    lease = await store.create_lease(5.0)
    plane = make_event_plane("zmq", store=store, lease=lease, host="127.0.0.1")
    assert isinstance(plane, ZmqEventPlane) and isinstance(plane, EventPlane)
    assert plane.lease is lease and plane.host == "127.0.0.1"
    await store.close()


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match="nats, zmq"):
        make_event_plane("kafka", nats_url="nats://x")


def test_wildcard_component_is_one_token() -> None:
    assert scope_subject("dyn", "backend", "kv-events") == nats_subject("dyn", "backend", "kv-events")
    assert scope_subject("dyn", "*", "kv-events") == "namespace.dyn.component.*.kv-events"
    # A dotted name must not widen the scope into other subjects.
    assert scope_subject("a.b", "*", "t") == "namespace.a_b.component.*.t"


def test_one_stream_per_namespace_and_topic() -> None:
    assert stream_subject("dyn", "kv-events") == "namespace.dyn.component.*.kv-events"
    name = stream_name("my.ns", "kv-events")
    assert "." not in name and "*" not in name and " " not in name
    assert stream_name("dyn", "kv-events") != stream_name("dyn", "kv_metrics")


def test_durable_names_are_not_mangled() -> None:
    assert consumer_name("kv-router_1") == "kv-router_1"
    for bad in ("", "a.b", "x y", "r*"):
        with pytest.raises(InvalidRequestError):
            consumer_name(bad)
