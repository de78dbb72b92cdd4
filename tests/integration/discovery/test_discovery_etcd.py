"""etcd discovery against a real etcd, with the registering side in a real child process.

What a user relies on: a worker registered in one process is discovered by another; a worker
killed with -9 disappears within its lease TTL; a clean shutdown disappears at once; etcd restarts
(even longer than the TTL, even with its data lost) do not lose registrations or break watches.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest

from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.discovery.etcd_endpoints import parse_etcd_endpoints
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.errors import ConfigError, DiscoveryError
from tests.fixtures.servers import EtcdServer, free_port
from tests.integration.discovery.helpers_discovery import Registrars, WatchRecorder, check_close_removes_keys

TTL = 2.0  # etcd's minimum lease TTL on a default server
KEY = "v1/instances/ns/backend/generate/abc"
PREFIX = "v1/instances/ns/"


@pytest.fixture
async def store(etcd_server: EtcdServer):
    s = EtcdStore([etcd_server.endpoint])
    await s.start()
    yield s
    await s.close()


@pytest.fixture
async def children():
    registrars = Registrars("etcd")
    yield registrars.spawn
    await registrars.cleanup()


async def test_store_is_a_discovery_store(store: EtcdStore) -> None:
    assert isinstance(store, DiscoveryStore)
    assert store.name == "etcd"


async def test_put_get_prefix_delete_and_lease_revoke(store: EtcdStore) -> None:
    lease = await store.create_lease(TTL)
    await store.put("p/a", b"1", lease)
    await store.put("p/b", b"2")
    await store.put("q/c", b"3")
    assert await store.get("p/a") == b"1"
    assert await store.get("p/none") is None
    assert await store.get_prefix("p/") == {"p/a": b"1", "p/b": b"2"}
    await store.delete("p/b")
    assert await store.get_prefix("p/") == {"p/a": b"1"}
    await lease.revoke()
    assert await store.get("p/a") is None
    with pytest.raises(DiscoveryError):
        await store.put("p/x", b"x", lease)


async def test_child_registration_is_discovered_then_gone_within_ttl_after_kill9(
    etcd_server: EtcdServer, store: EtcdStore, children
) -> None:
    child = await children(etcd_server.endpoint, TTL, {KEY: "worker-1"})
    assert await store.get_prefix(PREFIX) == {KEY: b"worker-1"}
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: v == {KEY: b"worker-1"}, 5, "snapshot")

    killed_at = time.monotonic()
    child.kill9()
    gone_at = await watch.wait_for(lambda v: KEY not in v, TTL + 2.0, "key removed after kill -9")
    assert gone_at - killed_at <= TTL + 1.0  # etcd expires leases on a 0.5 s tick
    assert await store.get(KEY) is None
    await watch.stop()


async def test_clean_close_removes_keys_at_once(etcd_server: EtcdServer, store: EtcdStore, children) -> None:
    child = await children(etcd_server.endpoint, 30.0, {KEY: "w", KEY + "/lora": "l"})
    await check_close_removes_keys(store, PREFIX, child, 5.0)


async def test_restart_longer_than_ttl_keeps_leases_and_resumes_watch(
    etcd_server: EtcdServer, store: EtcdStore, children
) -> None:
    child = await children(etcd_server.endpoint, TTL, {KEY: "worker-1"})
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: KEY in v, 5, "snapshot")

    await asyncio.to_thread(etcd_server.restart, TTL + 1.0)

    # A change made after the restart reaches the watch that was open before it.
    writer = EtcdStore([etcd_server.endpoint])
    await writer.start()
    await writer.put(PREFIX + "after-restart", b"new")
    await watch.wait_for(lambda v: v.get(PREFIX + "after-restart") == b"new", 10, "change after restart")
    # The child's key (leased, TTL 2 s) is there after the outage and stays beyond one more TTL.
    assert await store.get(KEY) == b"worker-1"
    deadline = time.monotonic() + 1.5 * TTL
    while time.monotonic() < deadline:
        assert await store.get(KEY) == b"worker-1", "leased key expired after the restart"
        await asyncio.sleep(0.2)
    assert watch.view == await store.get_prefix(PREFIX)
    assert child.proc is not None and child.proc.returncode is None
    await writer.close()
    await watch.stop()


async def test_restart_with_data_loss_reputs_leased_keys_and_fixes_watch_view(
    etcd_server: EtcdServer, store: EtcdStore, children
) -> None:
    child = await children(etcd_server.endpoint, TTL, {KEY: "worker-1"})
    await store.put(PREFIX + "unleased", b"gone-with-the-data")
    watch = WatchRecorder(store, PREFIX).start()
    await watch.wait_for(lambda v: len(v) == 2, 5, "snapshot")

    def wipe_and_restart() -> None:
        etcd_server.stop()
        shutil.rmtree(os.path.join(etcd_server.data_dir, "data"))
        etcd_server.start()

    await asyncio.to_thread(wipe_and_restart)

    # The child re-grants its lease (same id) and re-puts its key; the watcher re-lists and drops
    # the key that died with the data.
    await watch.wait_for(lambda v: v == {KEY: b"worker-1"}, 10, "view after data loss")
    assert await store.get_prefix(PREFIX) == {KEY: b"worker-1"}
    assert any(ev.kind is WatchEventKind.DELETE and ev.key == PREFIX + "unleased" for _, ev in watch.events)
    # The key is under a live lease again: killing the owner still removes it within the TTL.
    child.kill9()
    await watch.wait_for(lambda v: not v, TTL + 2.0, "key removed after kill -9")
    await watch.stop()


async def test_own_lease_is_regranted_with_same_id_after_data_loss(etcd_server: EtcdServer) -> None:
    s = EtcdStore([etcd_server.endpoint])
    await s.start()
    lease = await s.create_lease(TTL)
    first_id = lease.id
    await s.put("own/a", b"1", lease)

    def wipe_and_restart() -> None:
        etcd_server.stop()
        shutil.rmtree(os.path.join(etcd_server.data_dir, "data"))
        etcd_server.start()

    await asyncio.to_thread(wipe_and_restart)
    # A put on the lost lease re-grants it at once instead of failing.
    await s.put("own/b", b"2", lease)
    assert lease.id == first_id
    assert await s.get_prefix("own/") == {"own/a": b"1", "own/b": b"2"}
    await s.close()
    checker = EtcdStore([etcd_server.endpoint])
    await checker.start()
    assert await checker.get_prefix("own/") == {}
    await checker.close()


async def test_watch_resyncs_when_its_revision_was_compacted(store: EtcdStore) -> None:
    await store.put("c/keep", b"1")
    await store.put("c/drop", b"2")
    watch = store.watch_prefix("c/")
    snapshot = {(await asyncio.wait_for(watch.__anext__(), 5)).key for _ in range(2)}
    assert snapshot == {"c/keep", "c/drop"}
    # While the consumer is not reading (the generator is parked after the snapshot), history it
    # has not seen is compacted away; the watch must re-list and emit the difference.
    await store.delete("c/drop")
    await store.put("c/new", b"3")
    await store.put("c/keep", b"1b")
    from etcd3aio._protobuf import CompactionRequest, RangeRequest

    kv = store._stubs()[0]
    rev = (await kv.Range(RangeRequest(key=b"c/"))).header.revision
    await kv.Compact(CompactionRequest(revision=rev, physical=True))
    events = [await asyncio.wait_for(watch.__anext__(), 5) for _ in range(3)]
    got = {(ev.kind, ev.key, ev.value) for ev in events}
    assert got == {
        (WatchEventKind.DELETE, "c/drop", None),
        (WatchEventKind.PUT, "c/keep", b"1b"),
        (WatchEventKind.PUT, "c/new", b"3"),
    }
    await store.put("c/later", b"4")
    ev = await asyncio.wait_for(watch.__anext__(), 5)
    assert (ev.kind, ev.key) == (WatchEventKind.PUT, "c/later")
    await watch.aclose()


async def test_watch_notices_data_loss_even_when_etcd_revision_overtook_it(etcd_server: EtcdServer) -> None:
    s = EtcdStore([etcd_server.endpoint])
    await s.start()
    await s.put("d/a", b"1")
    await s.put("d/b", b"2")
    watch = s.watch_prefix("d/")
    assert {(await asyncio.wait_for(watch.__anext__(), 5)).key for _ in range(2)} == {"d/a", "d/b"}

    def wipe_and_restart() -> None:
        etcd_server.stop()
        shutil.rmtree(os.path.join(etcd_server.data_dir, "data"))
        etcd_server.start()

    # While the consumer is parked, etcd comes back empty and its revision passes the watcher's,
    # with "d/a" even re-created at the very same revision: only the content tells them apart.
    await asyncio.to_thread(wipe_and_restart)
    await s.put("d/a", b"1")
    await s.put("elsewhere/1", b"x")
    await s.put("elsewhere/2", b"x")
    ev = await asyncio.wait_for(watch.__anext__(), 10)
    assert (ev.kind, ev.key) == (WatchEventKind.DELETE, "d/b")
    await s.put("d/c", b"3")
    ev = await asyncio.wait_for(watch.__anext__(), 5)
    assert (ev.kind, ev.key, ev.value) == (WatchEventKind.PUT, "d/c", b"3")
    await watch.aclose()
    await s.close()


async def test_close_ends_open_watches(etcd_server: EtcdServer) -> None:
    s = EtcdStore([etcd_server.endpoint])
    await s.start()
    watch = WatchRecorder(s, "x/").start()
    await asyncio.sleep(0)  # let the watch start its snapshot
    await s.put("x/a", b"1")
    await watch.wait_for(lambda v: "x/a" in v, 5, "put")
    await s.close()
    await watch.wait_ended(5)
    await watch.stop()


async def test_unreachable_etcd_fails_fast_with_actionable_error() -> None:
    port = free_port()  # nothing listens here
    s = EtcdStore([f"127.0.0.1:{port}"], connect_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(DiscoveryError) as info:
        await s.start()
    assert time.monotonic() - started < 3.0
    message = str(info.value)
    assert f"http://127.0.0.1:{port}" in message and "\n" not in message
    assert "ETCD_ENDPOINTS" in message


async def test_make_store_builds_an_unstarted_etcd_store(etcd_server: EtcdServer, monkeypatch) -> None:
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    s = make_store("etcd")
    assert isinstance(s, EtcdStore) and s.endpoints == [etcd_server.endpoint]
    with pytest.raises(DiscoveryError):
        await s.put("k", b"v")  # not started yet
    await s.start()
    await s.put("k", b"v")
    assert await s.get("k") == b"v"
    await s.close()


def test_parse_etcd_endpoints() -> None:
    assert parse_etcd_endpoints("127.0.0.1:2379") == ["http://127.0.0.1:2379"]
    assert parse_etcd_endpoints(" http://etcd-0:2379 , etcd-1:2380,etcd-2") == [
        "http://etcd-0:2379",
        "http://etcd-1:2380",
        "http://etcd-2:2379",
    ]
    assert parse_etcd_endpoints("[::1]:2379") == ["http://[::1]:2379"]
    assert parse_etcd_endpoints("https://etcd:2379") == ["https://etcd:2379"]  # TLS: test_security_etcd.py
    for bad in ("", " , ", "grpc://etcd:2379", "etcd:notaport", "http://etcd:2379/path", "etcd:99999"):
        with pytest.raises(ConfigError):
            parse_etcd_endpoints(bad)
