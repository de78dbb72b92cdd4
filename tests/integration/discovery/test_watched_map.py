"""WatchedMap over the real backends: an etcd restarted mid-watch (with its data, and wiped), a key
deleted between the seed listing and the watch on etcd, and file discovery shared by two stores
(a writer's lease ending, its key files wiped and put back by its heartbeat)."""

from __future__ import annotations

import asyncio
import os
import shutil

from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.discovery.file import FileStore, encode_key
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.runtime.watched_map import WatchedMap
from tests.fixtures.discovery_faults import delete_before_watch
from tests.fixtures.servers import EtcdServer

P = "v1/test/"


def text(_key: str, raw: bytes) -> str:
    return raw.decode()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []

    def __call__(self, key: str, value: str | None) -> None:
        self.events.append((key.removeprefix(P), value))


async def started_map(store: DiscoveryStore) -> tuple[WatchedMap[str], Recorder]:
    """A started map of ``P`` on ``store`` and the recorder of what its listener was told."""
    seen = Recorder()
    m: WatchedMap[str] = WatchedMap(store, P, text)
    m.add_listener(seen)
    await m.start()
    return m, seen


async def test_etcd_restarted_mid_watch_with_its_data_and_then_wiped(etcd_server: EtcdServer) -> None:
    store = EtcdStore([etcd_server.endpoint])
    await store.start()
    await store.put(P + "a", b"1")
    await store.put(P + "b", b"2")
    m, seen = await started_map(store)
    try:
        assert seen.events == [("a", "1"), ("b", "2")]
        await asyncio.to_thread(etcd_server.restart)  # the data survives: the watch resumes
        await store.put(P + "c", b"3")
        await store.delete(P + "a")
        await m.wait_for(lambda: dict(m.view) == {P + "b": "2", P + "c": "3"}, 15)
        assert seen.events[2:] == [("c", "3"), ("a", None)]

        def wipe_and_restart() -> None:
            etcd_server.stop()
            shutil.rmtree(os.path.join(etcd_server.data_dir, "data"))
            etcd_server.start()

        await asyncio.to_thread(wipe_and_restart)
        await store.put(P + "d", b"4")
        # The keys that vanished with the data are removed; the one written since is there.
        await m.wait_for(lambda: dict(m.view) == {P + "d": "4"}, 15)
        assert sorted(seen.events[4:]) == [("b", None), ("c", None), ("d", "4")]
    finally:
        await m.close()
        await store.close()


async def test_etcd_key_deleted_between_listing_and_watch_is_told_gone(etcd_server: EtcdServer) -> None:
    """The watch starts at the listing's revision: the delete in between arrives as an event (no
    periodic reconciliation here to catch it)."""
    store = EtcdStore([etcd_server.endpoint])
    await store.start()
    await store.put(P + "live", b"1")
    await store.put(P + "ghost", b"2")
    delete_before_watch(store, P + "ghost")
    m, seen = await started_map(store)
    try:
        assert P + "ghost" in m  # the listing had it
        await m.wait_for(lambda: P + "ghost" not in m, 5)
        assert seen.events == [("ghost", "2"), ("live", "1"), ("ghost", None)]
    finally:
        await m.close()
        await store.close()


async def test_file_discovery_follows_another_stores_lease_and_its_wiped_keys(tmp_path) -> None:
    root = str(tmp_path / "kv")
    writer, reader = FileStore(root, poll_interval_s=0.05), FileStore(root, poll_interval_s=0.05)
    await writer.start()
    await reader.start()
    try:
        lease = await writer.create_lease(1.0)
        await writer.put(P + "a", b"1", lease)
        await writer.put(P + "b", b"2", lease)
        await writer.put(P + "unleased", b"3")
        m, seen = await started_map(reader)
        try:
            assert dict(m.view) == {P + "a": "1", P + "b": "2", P + "unleased": "3"}
            # Key files wiped (a tmp cleaner): the unleased one is gone for good; the live owner's
            # heartbeat puts its own back (a reader may or may not see it missing meanwhile).
            for key in (P + "a", P + "unleased"):
                await asyncio.to_thread(os.unlink, tmp_path / "kv" / "keys" / encode_key(key))
            await m.wait_for(lambda: ("unleased", None) in seen.events, 10)
            await m.wait_for(lambda: dict(m.view) == {P + "a": "1", P + "b": "2"}, 10)
            await lease.revoke()  # the writer's process ends: its keys go with its lease
            await m.wait_for(lambda: not m, 10)
            assert seen.events[-2:] == [("a", None), ("b", None)]
        finally:
            await m.close()
    finally:
        await reader.close()
        await writer.close()
