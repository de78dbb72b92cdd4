"""The in-process backend: the reference semantics the etcd and file backends are held to."""

from __future__ import annotations

import asyncio

import pytest

from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.discovery.store import DiscoveryStore, Lease, WatchEvent, WatchEventKind
from dynamod.shared.errors import DiscoveryError


@pytest.fixture
async def store():
    s = MemStore()
    await s.start()
    yield s
    await s.close()


async def next_event(it, timeout: float = 2.0) -> WatchEvent:
    return await asyncio.wait_for(it.__anext__(), timeout)


def test_mem_store_implements_the_protocols() -> None:
    s = MemStore()
    assert isinstance(s, DiscoveryStore)
    assert s.name == "mem"


async def test_put_get_get_prefix_delete(store: MemStore) -> None:
    await store.put("v1/instances/ns/a/gen/1", b"one")
    await store.put("v1/instances/ns/b/gen/2", b"two")
    await store.put("v1/mdc/ns/a/gen/1", b"card")
    assert await store.get("v1/instances/ns/a/gen/1") == b"one"
    assert await store.get("v1/instances/ns/missing") is None
    assert await store.get_prefix("v1/instances/ns/") == {
        "v1/instances/ns/a/gen/1": b"one",
        "v1/instances/ns/b/gen/2": b"two",
    }
    await store.put("v1/instances/ns/a/gen/1", b"one-v2")
    assert await store.get("v1/instances/ns/a/gen/1") == b"one-v2"
    await store.delete("v1/instances/ns/a/gen/1")
    assert await store.get("v1/instances/ns/a/gen/1") is None
    assert list(await store.get_prefix("v1/instances/")) == ["v1/instances/ns/b/gen/2"]


async def test_lease_has_id_and_ttl_and_revoke_removes_its_keys(store: MemStore) -> None:
    lease = await store.create_lease(5.0)
    assert isinstance(lease, Lease)
    assert lease.id > 0 and lease.ttl == 5.0
    other = await store.create_lease(5.0)
    assert other.id != lease.id
    await store.put("k/leased", b"1", lease)
    await store.put("k/other", b"2", other)
    await store.put("k/plain", b"3")
    await lease.revoke()
    assert await store.get_prefix("k/") == {"k/other": b"2", "k/plain": b"3"}
    with pytest.raises(DiscoveryError):
        await store.put("k/again", b"x", lease)


async def test_expire_lease_removes_keys_like_a_dead_owner(store: MemStore) -> None:
    lease = await store.create_lease(2.0)
    await store.put("v1/instances/ns/c/e/1", b"x", lease)
    watch = store.watch_prefix("v1/instances/")
    assert (await next_event(watch)).kind is WatchEventKind.PUT
    store.expire_lease(lease.id)
    ev = await next_event(watch)
    assert (ev.kind, ev.key, ev.value) == (WatchEventKind.DELETE, "v1/instances/ns/c/e/1", None)
    assert await store.get("v1/instances/ns/c/e/1") is None
    await watch.aclose()


async def test_unleased_put_detaches_a_key_from_its_lease(store: MemStore) -> None:
    lease = await store.create_lease(2.0)
    await store.put("k", b"leased", lease)
    await store.put("k", b"plain")
    await lease.revoke()
    assert await store.get("k") == b"plain"


async def test_watch_gives_snapshot_then_changes_under_prefix_only(store: MemStore) -> None:
    await store.put("p/a", b"1")
    await store.put("p/b", b"2")
    await store.put("q/x", b"0")
    watch = store.watch_prefix("p/")
    snapshot = {(await next_event(watch)).key for _ in range(2)}
    assert snapshot == {"p/a", "p/b"}
    await store.put("q/y", b"ignored")
    await store.put("p/c", b"3")
    await store.delete("p/a")
    ev1, ev2 = await next_event(watch), await next_event(watch)
    assert (ev1.kind, ev1.key, ev1.value) == (WatchEventKind.PUT, "p/c", b"3")
    assert (ev2.kind, ev2.key) == (WatchEventKind.DELETE, "p/a")
    await watch.aclose()


async def test_close_revokes_leases_and_ends_watches() -> None:
    s = MemStore()
    await s.start()
    lease = await s.create_lease(5.0)
    await s.put("k", b"v", lease)
    watch = s.watch_prefix("k")
    await next_event(watch)
    pending = asyncio.ensure_future(watch.__anext__())
    await s.close()
    # The lease's key is deleted, then the watch ends.
    ev = await asyncio.wait_for(pending, 2)
    assert ev.kind is WatchEventKind.DELETE
    with pytest.raises(StopAsyncIteration):
        await next_event(watch)
    with pytest.raises(DiscoveryError):
        await s.put("k", b"v")


async def test_close_waits_for_its_reaper() -> None:
    """No task of the store outlives close (a pending reaper would be destroyed with the loop)."""
    s = MemStore()
    await s.start()
    before = {t for t in asyncio.all_tasks() if t.get_name() == "mem-discovery-reaper"}
    assert len(before) == 1
    await s.close()
    (reaper,) = before
    assert reaper.done()
