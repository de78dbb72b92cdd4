"""Repairs found in review: dead peers on the request plane, ghost instances, the status server's
stop and busy port, the half-built runtime, ZMQ's advertised address, status adopted only after the
store write, and close paths that keep their caller's cancellation.

Each test fails without its repair. Closing a discovery store with a real etcd is in
tests/integration/test_runtime_repairs_etcd.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable

import pytest
import uvloop
from prometheus_client import CollectorRegistry

from dynamod.daemon.engines.common.kv_subscriber import NativeKvSubscriber, SubscriberEndpoint
from dynamod.daemon.engines.mocker.engine import MockerEngine
from dynamod.daemon.worker.metrics import WorkerMetrics
from dynamod.daemon.worker.service import WorkerService
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.file import FileStore
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import ConfigError, DiscoveryError
from dynamod.shared.events.zmq_plane import ZmqEventPlane
from dynamod.shared.observability.status_server import StatusServer
from dynamod.shared.protocol.instance import Instance, decode_instance, encode_instance
from dynamod.shared.protocol.keys import instance_key, instances_prefix
from dynamod.shared.protocol.model_card import ModelCard
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.runtime.instances import InstanceSet
from dynamod.shared.transport.address import advertised_host
from dynamod.shared.transport.plane import RequestContext
from dynamod.shared.transport.tcp_client import TcpRequestClient
from dynamod.shared.transport.tcp_server import TcpRequestServer
from tests.fixtures.discovery_faults import FlakyStore, delete_before_watch
from tests.unit.mocker.factories import make_config
from tests.unit.runtime.support import until


def _record(iid: int) -> bytes:
    return encode_instance(
        Instance(namespace="ns", component="c", endpoint="e", instance_id=iid, transport="tcp", address="127.0.0.1:1")
    )


# -- dead peers on the TCP request plane ---------------------------------------------------------


def _keepalive_options(sock: socket.socket) -> tuple[int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    )


async def _request_plane_sockets_probe_their_peer() -> None:
    async def echo(body: object, ctx: RequestContext):
        yield body

    server = TcpRequestServer()
    server.register("echo", echo)
    address = await server.start()
    client = TcpRequestClient()
    try:
        assert [x async for x in client.stream(address, "echo", "hi")] == ["hi"]
        [client_conn] = list(client._conns.values())
        [server_conn] = list(server._connections)
        for conn in (client_conn, server_conn):
            assert conn._transport is not None
            enabled, idle, interval, probes = _keepalive_options(conn._transport.get_extra_info("socket"))
            assert enabled == 1
            # Declared dead within seconds, not after the kernel's default of over two hours.
            assert idle + interval * probes <= 15
    finally:
        await client.close()
        await server.stop(0)


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="keep-alive timing is tuned on Linux only")
async def test_request_plane_connections_use_tcp_keepalive() -> None:
    """A peer whose machine died never closes its connection: only keep-alive probes end it (in
    about idle + interval * probes seconds) so the stream fails and can migrate."""
    await _request_plane_sockets_probe_their_peer()


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="keep-alive timing is tuned on Linux only")
def test_request_plane_connections_use_tcp_keepalive_on_uvloop() -> None:
    """The daemons run uvloop, whose transports hand out their own socket objects."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_request_plane_sockets_probe_their_peer())


# -- ghost instances -----------------------------------------------------------------------------


async def test_reconcile_drops_a_ghost_only_after_two_reads_and_adds_a_missed_key() -> None:
    store = MemStore()
    await store.start()
    ghost, fresh = instance_key("ns", "c", "e", 1), instance_key("ns", "c", "e", 2)
    view = InstanceSet(store, instances_prefix("ns", "c", "e"))
    # A view that believes in an instance whose key is already gone (its DELETE was never seen).
    view._apply_put(ghost, _record(1))
    assert view.reconcile({fresh: _record(2)}) is False  # one read is not enough
    assert [i.instance_id for i in view.instances] == [1]
    assert view.reconcile({fresh: _record(2)}) is True
    assert [i.instance_id for i in view.instances] == [2]
    assert view.get(1) is None and view.get(2) is not None  # the id index follows
    await store.close()


async def test_a_change_seen_by_only_one_read_is_left_alone() -> None:
    store = MemStore()
    await store.start()
    key = instance_key("ns", "c", "e", 3)
    view = InstanceSet(store, instances_prefix("ns", "c", "e"))
    view._apply_put(key, _record(3))
    view.reconcile({})  # a read racing with a fresh PUT
    view.reconcile({key: _record(3)})
    view.reconcile({})
    assert [i.instance_id for i in view.instances] == [3]
    await store.close()


class StaleListingStore(MemStore):
    """The first listing still shows a key that is deleted before the watch starts: what a real
    backend returns when the instance's lease expires between the seed read and the watch."""

    def __init__(self, ghost_key: str, ghost_value: bytes) -> None:
        super().__init__()
        self._ghost: tuple[str, bytes] | None = (ghost_key, ghost_value)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        listing = await super().get_prefix(prefix)
        if self._ghost is not None:
            key, value = self._ghost
            self._ghost = None
            listing[key] = value
        return listing


@pytest.mark.parametrize("backend", ["mem", "file"])
async def test_an_instance_deleted_between_seed_and_watch_leaves_the_view(backend: str, tmp_path) -> None:
    ghost_key, live_key = instance_key("ns", "c", "e", 1), instance_key("ns", "c", "e", 2)
    if backend == "mem":
        store = StaleListingStore(ghost_key, _record(1))
        await store.start()
        await store.put(live_key, _record(2))
        view = InstanceSet(store, instances_prefix("ns", "c", "e"), reconcile_interval_s=0.05)
        await view.start()
    else:
        store = FileStore(str(tmp_path / "kv"), poll_interval_s=0.02)
        await store.start()
        await store.put(ghost_key, _record(1))
        await store.put(live_key, _record(2))
        view = InstanceSet(store, instances_prefix("ns", "c", "e"), reconcile_interval_s=0.05)
        delete_before_watch(store, ghost_key)
        await view.start()
    try:
        assert sorted(i.instance_id for i in view.instances) == [1, 2]  # seeded with the ghost
        # wait_for wakes on the reconciliation (no watch event ever comes for the ghost).
        await view.wait_for(lambda insts: [i.instance_id for i in insts] == [2], timeout=5)
        assert view.get(1) is None
        # A live instance is never reconciled away.
        await asyncio.sleep(0.3)
        assert [i.instance_id for i in view.instances] == [2]
    finally:
        await view.close()
        await store.close()


# -- status server -------------------------------------------------------------------------------


async def test_status_server_stop_closes_a_scrapers_keepalive_connection() -> None:
    """Python 3.12+ wait_closed() waits for open connections: a Prometheus scraper's keep-alive
    connection would hold shutdown (and the lease revocation after it) for ever."""
    server = StatusServer(CollectorRegistry(), lambda: (True, {}), port=0)
    url = await server.start()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"200 OK" in head and b"keep-alive" in head.lower()
        await asyncio.wait_for(reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])), 5)
        await asyncio.wait_for(server.stop(), 5)
        # The server hung up on the idle scraper instead of waiting up to 30 s for its next request.
        assert await asyncio.wait_for(reader.read(), 2) == b""
    finally:
        writer.close()


async def test_busy_status_port_is_a_config_error_naming_the_flag() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        server = StatusServer(CollectorRegistry(), lambda: (True, {}), port=holder.getsockname()[1])
        with pytest.raises(ConfigError, match="--system-port") as err:
            await server.start()
        assert str(holder.getsockname()[1]) in str(err.value)
    finally:
        holder.close()


async def test_busy_status_port_releases_the_half_built_runtime(tmp_path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    root = str(tmp_path / "kv")
    settings = RuntimeSettings(
        discovery_backend="file", file_kv=root, event_plane="zmq", system_port=holder.getsockname()[1]
    )
    before = asyncio.all_tasks()
    try:
        with pytest.raises(ConfigError, match="--system-port"):
            await DistributedRuntime.create(settings)
        # Nothing left running: no lease keep-alive, no watcher, and the lease is gone from disk.
        leftover = [t for t in asyncio.all_tasks() - before if not t.done()]
        assert leftover == []
        reader = FileStore(root)
        await reader.start()
        try:
            assert await reader.get_prefix("") == {}
            leases = await asyncio.to_thread(lambda: [p.name for p in (tmp_path / "kv").rglob("*.lease")])
            assert leases == []
        finally:
            await reader.close()
    finally:
        holder.close()


# -- ZMQ publishers advertise the runtime's --host -----------------------------------------------


async def _advertised_publisher_address(store: MemStore) -> str:
    [value] = (await store.get_prefix("v1/event_channels/")).values()
    return str(json.loads(value)["address"])


async def test_zmq_publisher_on_a_wildcard_host_advertises_a_dialable_address() -> None:
    store = MemStore()
    await store.start()
    lease = await store.create_lease(5)
    plane = ZmqEventPlane(store, lease, host="0.0.0.0")
    await plane.start()
    try:
        pub = await plane.publisher("ns", "c", "t")
        address = await _advertised_publisher_address(store)
        assert address.startswith(f"tcp://{advertised_host('0.0.0.0')}:")
        assert "0.0.0.0" not in address
        await pub.close()
    finally:
        await plane.close()
        await store.close()


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


# -- status adopted only after the store write ---------------------------------------------------


async def _served(store: FlakyStore) -> tuple[DistributedRuntime, object]:
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq"), store=store)

    async def handler(body: object, ctx: RequestContext):
        yield body

    served = await rt.namespace("ns").component("c").endpoint("e").serve(handler)
    return rt, served


async def _stored(store: MemStore, served) -> Instance | None:
    raw = await store.get(served.key)
    return decode_instance(raw) if raw is not None else None


async def test_set_status_and_labels_after_a_failed_write_are_written_by_the_retry() -> None:
    store = FlakyStore()
    rt, served = await _served(store)
    try:
        store.fail_prefix, store.failures_left = served.key, 1
        with pytest.raises(DiscoveryError):
            await served.set_status("draining")
        assert served.record.status == "ready"  # not adopted: discovery still says ready
        await served.set_status("draining")  # the operator's retry
        assert (await _stored(store, served)).status == "draining"
        assert served.record.status == "draining"

        store.failures_left = 1
        with pytest.raises(DiscoveryError):
            await served.update_labels(pool="a")
        assert "pool" not in served.record.labels
        await served.update_labels(pool="a")
        assert (await _stored(store, served)).labels == {"pool": "a"}
    finally:
        await rt.shutdown(0)


async def test_deregister_after_a_failed_delete_is_done_by_the_retry() -> None:
    store = FlakyStore()
    rt, served = await _served(store)
    try:
        store.fail_prefix, store.failures_left = served.key, 1
        with pytest.raises(DiscoveryError):
            await served.deregister()
        assert served.registered
        await served.deregister()
        assert await _stored(store, served) is None and not served.registered
    finally:
        await rt.shutdown(0)


async def test_advertised_instances_export_no_component_request_metrics() -> None:
    """Only request-plane handlers get dynamo_component_* series; the frontend's HTTP instance
    (advertised, not served) would otherwise export request counters that stay at zero."""
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq"))
    try:
        await rt.namespace("ns").component("frontend").endpoint("http").advertise(
            transport="http", address="127.0.0.1:8000"
        )
        series = [
            s.labels
            for metric in rt.registry.collect()
            for s in metric.samples
            if metric.name.startswith("dynamo_component") and s.labels.get("dynamo_component") == "frontend"
        ]
        assert series == []
    finally:
        await rt.shutdown(0)


def _card(info) -> ModelCard:
    return ModelCard(
        served_model_name="m",
        model_types=["chat"],
        tokenizer_source="t",
        context_length=info.context_length,
        kv_block_size=info.kv_block_size,
        runtime_config=info.runtime_config,
    )


async def test_worker_sleep_during_a_failed_write_reaches_discovery_when_it_answers() -> None:
    store = FlakyStore()
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq"), store=store)
    lease = await rt.create_lease()
    engine = MockerEngine(make_config(num_gpu_blocks=64, speedup_ratio=1000.0), lease.id)
    svc = WorkerService(
        rt.namespace().component("backend"), engine, _card, lease, role="", metrics=WorkerMetrics(CollectorRegistry())
    )
    await svc.start()
    try:
        generate = next(s for s in svc._served if s.record.endpoint == "generate")
        store.fail_prefix, store.failures_left = generate.key, 1
        replies = [x async for x in svc._sleep({"level": 1}, None)]
        # The worker sleeps at once; discovery gets the status when it takes the write again.
        assert svc.status == "sleeping" and replies[-1]["state"] == "sleeping"
        await until(lambda: not generate.write_pending, timeout=10)
        assert (await _stored(store, generate)).status == "sleeping"
        assert all(s.record.status == "sleeping" for s in svc._served)
    finally:
        await svc.stop(grace_s=0)
        await rt.shutdown(0)


# -- close paths keep the caller's cancellation ----------------------------------------------------


async def _stubborn(entered: asyncio.Event, release: asyncio.Event) -> None:
    """A background task that takes a while to wind down once cancelled (a socket being closed, a
    thread finishing a file write), so its owner's close() is still waiting on it."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        entered.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                pass
        raise


async def _assert_close_keeps_caller_cancellation(
    install: Callable[[asyncio.Task[None]], None], close: Callable[[], Awaitable[None]]
) -> None:
    """``install`` puts a stubborn task where ``close`` cancels and awaits it; the caller of close
    is cancelled meanwhile and must end cancelled, not return as if nothing happened."""
    entered, release = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_stubborn(entered, release))
    await asyncio.sleep(0)
    install(task)
    closer = asyncio.create_task(close())
    await asyncio.wait_for(entered.wait(), 5)
    closer.cancel()
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.wait([closer], timeout=5)
    assert closer.done()
    assert closer.cancelled(), "close() swallowed its caller's cancellation"


async def _assert_close_without_caller_cancellation_returns(
    install: Callable[[asyncio.Task[None]], None], close: Callable[[], Awaitable[None]]
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    release.set()
    task = asyncio.create_task(_stubborn(entered, release))
    await asyncio.sleep(0)
    install(task)
    await asyncio.wait_for(close(), 5)  # the task's own cancellation is not the caller's


async def test_instance_set_close_keeps_the_callers_cancellation() -> None:
    store = MemStore()
    await store.start()
    for expect_cancel in (True, False):
        view = InstanceSet(store, instances_prefix("ns"))
        await view.start()
        assert view._task is not None
        view._task.cancel()

        def install(task: asyncio.Task[None], view: InstanceSet = view) -> None:
            view._task = task

        check = _assert_close_keeps_caller_cancellation if expect_cancel else _assert_close_without_caller_cancellation_returns
        await check(install, view.close)
        assert view._task is None and view._reconciler is None
    await store.close()


async def test_native_kv_subscriber_close_keeps_the_callers_cancellation() -> None:
    for expect_cancel in (True, False):
        sub = NativeKvSubscriber(
            [SubscriberEndpoint("tcp://127.0.0.1:*", bind=True)],
            decode=lambda raw: None,  # type: ignore[arg-type,return-value]
            on_batch=lambda rank, batch: None,
            on_gap=lambda rank, missing: None,
        )

        def install(task: asyncio.Task[None], sub: NativeKvSubscriber = sub) -> None:
            sub._task = task

        check = _assert_close_keeps_caller_cancellation if expect_cancel else _assert_close_without_caller_cancellation_returns
        await check(install, sub.close)
        assert sub._sub is None  # the sockets were closed either way


async def test_mocker_engine_stop_keeps_the_callers_cancellation() -> None:
    for expect_cancel in (True, False):
        engine = MockerEngine(make_config(), worker_id=1)
        await engine.start()

        def install(task: asyncio.Task[None], engine: MockerEngine = engine) -> None:
            engine._tasks.append(task)

        check = _assert_close_keeps_caller_cancellation if expect_cancel else _assert_close_without_caller_cancellation_returns
        await check(install, engine.stop)
        # The cleanup ran either way: kv_events() ends.
        assert engine._events.get_nowait() is None


async def test_file_store_lease_revoke_and_close_keep_the_callers_cancellation(tmp_path) -> None:
    for i, (expect_cancel, via_close) in enumerate([(True, False), (True, True), (False, False), (False, True)]):
        store = FileStore(str(tmp_path / f"kv{i}"))
        await store.start()
        lease = await store.create_lease(5)
        assert lease.task is not None
        lease.task.cancel()

        def install(task: asyncio.Task[None], lease=lease) -> None:
            lease.task = task

        check = _assert_close_keeps_caller_cancellation if expect_cancel else _assert_close_without_caller_cancellation_returns
        await check(install, store.close if via_close else lease.revoke)
        await store.close()
