"""What listeners write into discovery: an address another host can dial, never a wildcard; the
``--advertise-host`` / ``--request-plane-port`` flags and their ``DYN_*`` fallbacks.

The ZMQ publishers' repairs found in review (each test fails without its repair): a wildcard bind
advertises a dialable address, and the runtime's publishers advertise its ``--host``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from dynamod.shared.config import RuntimeSettings, add_runtime_args, settings_from_args
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import ConfigError
from dynamod.shared.events.zmq_plane import ZmqEventPlane
from dynamod.shared.observability.status_server import StatusServer
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.transport.address import (
    advertised_host,
    check_advertise_host,
    interface_addresses,
    join_host_port,
    primary_address,
)
from dynamod.shared.transport.tcp_server import TcpRequestServer


def _settings(*argv: str):  # noqa: ANN202
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    return settings_from_args(parser.parse_args(list(argv)))


def test_wildcard_binds_advertise_a_real_address() -> None:
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0") == primary_address() not in ("0.0.0.0", "")
    assert advertised_host("0.0.0.0", "203.0.113.9") == "203.0.113.9"
    assert all(not a.startswith("127.") for a in interface_addresses())
    assert join_host_port("fd00::1", 80) == "[fd00::1]:80" and join_host_port("10.0.0.1", 80) == "10.0.0.1:80"


@pytest.mark.parametrize("bad", ["", "0.0.0.0", "::", "host:8080", "http://host"])
def test_advertise_host_must_be_dialable(bad: str) -> None:
    with pytest.raises(ValueError, match="--advertise-host"):
        check_advertise_host(bad)


def test_flags_env_and_the_advertise_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings("--host", "0.0.0.0", "--advertise-host", "198.51.100.4", "--request-plane-port", "7001")
    assert (s.request_plane_port, s.advertised("0.0.0.0")) == (7001, "198.51.100.4")
    assert s.advertised("127.0.0.1") == "127.0.0.1"  # a loopback status server is reachable nowhere else
    monkeypatch.setenv("DYN_ADVERTISE_HOST", "node-7.example")
    monkeypatch.setenv("DYN_REQUEST_PLANE_PORT", "7100")
    s = _settings("--host", "10.0.0.7")
    assert (s.advertise_host, s.request_plane_port, s.advertised("10.0.0.7")) == ("node-7.example", 7100, "node-7.example")
    assert _settings("--request-plane-port", "7200").request_plane_port == 7200  # the flag wins
    monkeypatch.delenv("DYN_ADVERTISE_HOST")
    monkeypatch.delenv("DYN_REQUEST_PLANE_PORT")
    assert (_settings().advertise_host, _settings().request_plane_port) == (None, 0)
    with pytest.raises(ConfigError, match="0..65535"):
        _settings("--request-plane-port", "65536")
    with pytest.raises(ConfigError, match="not '0.0.0.0'"):
        _settings("--advertise-host", "0.0.0.0")


async def test_request_plane_binds_a_pinned_port_and_advertises_the_given_host() -> None:
    probe = TcpRequestServer("127.0.0.1", 0)
    port = int((await probe.start()).address.rsplit(":", 1)[1])
    await probe.stop(0)
    server = TcpRequestServer("127.0.0.1", port, advertise_host="node-a.internal")
    try:
        assert (await server.start()).address == f"node-a.internal:{port}"
    finally:
        await server.stop(0)


async def test_status_server_url_is_never_a_wildcard() -> None:
    server = StatusServer(CollectorRegistry(), lambda: (True, {}), host="0.0.0.0", port=0)
    try:
        url = await server.start()
        assert "0.0.0.0" not in url and url.startswith(f"http://{primary_address()}:")
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def _zmq_plane(**options: str) -> AsyncIterator[tuple[MemStore, ZmqEventPlane]]:
    """A started ZMQ event plane on an in-process store (and the store, to read what it advertised)."""
    store = MemStore()
    await store.start()
    lease = await store.create_lease(5.0)
    plane = ZmqEventPlane(store, lease, **options)
    await plane.start()
    try:
        yield store, plane
    finally:
        await plane.close()
        await store.close()


async def _advertised_publisher_address(store: MemStore) -> str:
    [value] = (await store.get_prefix("v1/event_channels/")).values()
    return str(json.loads(value)["address"])


async def test_zmq_publisher_advertises_the_given_host() -> None:
    async with _zmq_plane(host="0.0.0.0", advertise_host="10.44.0.9") as (_, plane):
        publisher = await plane.publisher("ns", "backend", "kv-events")
        assert publisher.address.startswith("tcp://10.44.0.9:")
        await publisher.close()


async def test_zmq_publisher_on_a_wildcard_host_advertises_a_dialable_address() -> None:
    async with _zmq_plane(host="0.0.0.0") as (store, plane):
        pub = await plane.publisher("ns", "c", "t")
        address = await _advertised_publisher_address(store)
        assert address.startswith(f"tcp://{advertised_host('0.0.0.0')}:")
        assert "0.0.0.0" not in address
        await pub.close()


async def test_runtime_zmq_events_advertise_its_host() -> None:
    store = MemStore()
    # 127.0.0.2 is loopback too, so the test needs no second machine; the old default was 127.0.0.1.
    settings = RuntimeSettings(discovery_backend="mem", event_plane="zmq", host="127.0.0.2")
    rt = await DistributedRuntime.create(settings, store=store)
    try:
        pub = await rt.namespace("ns").component("c").publisher("t")
        assert (await _advertised_publisher_address(store)).startswith("tcp://127.0.0.2:")
        sub = await rt.namespace("ns").component("c").subscribe("t")

        async def delivered() -> bytes:
            async for msg in sub:
                return msg.payload
            raise AssertionError("subscription ended")

        # The slow joiner misses what is sent before it is connected: publish until one arrives.
        receive = asyncio.create_task(delivered())
        try:
            for _ in range(500):
                await pub.publish("t", b"x")
                done, _ = await asyncio.wait([receive], timeout=0.01)
                if done:
                    break
            assert receive.done() and receive.result() == b"x"
        finally:
            receive.cancel()
            await sub.close()
            await pub.close()
    finally:
        await rt.shutdown(0)
