"""InstanceSet's index by instance id: lookups by id follow puts, replacements and deletes.

Also repairs found in review (each test fails without its repair): ghost instances, whose DELETE
was never seen, leave the view after two reads, and close() keeps its caller's cancellation. The
same on a real etcd: tests/integration/runtime/test_runtime_repairs_etcd.py.
"""

from __future__ import annotations

import asyncio

import pytest

from dynamod.shared.discovery.file import FileStore
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.instance import Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key, instances_prefix
from dynamod.shared.runtime.instances import InstanceSet
from tests.fixtures.cancellation import close_check
from tests.fixtures.discovery_faults import delete_before_watch
from tests.unit.runtime.support import until


def inst(iid: int, endpoint: str = "generate", status: str = "ready", address: str = "127.0.0.1:1") -> Instance:
    return Instance(namespace="ns", component="backend", endpoint=endpoint, instance_id=iid, transport="tcp", address=address, status=status)


async def put(store: DiscoveryStore, i: Instance) -> None:
    await store.put(instance_key(i.namespace, i.component, i.endpoint, i.instance_id), encode_instance(i))


async def test_get_by_id_follows_seed_put_update_and_delete(store: DiscoveryStore) -> None:
    await put(store, inst(1))
    instances = InstanceSet(store, instances_prefix("ns", "backend", "generate"))
    await instances.start()
    try:
        assert instances.get(1) == inst(1)
        assert instances.get(2) is None
        await put(store, inst(2))
        await until(lambda: instances.get(2) is not None)
        await put(store, inst(2, status="draining"))
        await until(lambda: instances.get(2).status == "draining")
        assert dict(instances.by_id) == {1: inst(1), 2: inst(2, status="draining")}
        await store.delete(instance_key("ns", "backend", "generate", 1))
        await until(lambda: instances.get(1) is None)
        assert list(instances.by_id) == [2]
        assert [i.instance_id for i in instances.instances] == [2]
    finally:
        await instances.close()


async def test_by_id_is_a_live_read_only_view(store: DiscoveryStore) -> None:
    instances = InstanceSet(store, instances_prefix("ns", "backend", "generate"))
    await instances.start()
    try:
        view = instances.by_id
        await put(store, inst(7))
        await until(lambda: 7 in view)
        try:
            view[8] = inst(8)  # type: ignore[index]
        except TypeError:
            pass
        else:
            raise AssertionError("by_id must not be writable")
    finally:
        await instances.close()


async def test_one_id_under_two_keys_stays_indexed_until_both_are_gone(store: DiscoveryStore) -> None:
    """A wider prefix (a whole component) holds one worker once per endpoint."""
    instances = InstanceSet(store, instances_prefix("ns", "backend"))
    await instances.start()
    try:
        await put(store, inst(5, endpoint="generate"))
        await put(store, inst(5, endpoint="kv_dump"))
        await until(lambda: len(instances.instances) == 2)
        await store.delete(instance_key("ns", "backend", "kv_dump", 5))
        await until(lambda: len(instances.instances) == 1)
        assert instances.get(5) == inst(5, endpoint="generate")
        await store.delete(instance_key("ns", "backend", "generate", 5))
        await until(lambda: not instances.instances)
        assert instances.get(5) is None
    finally:
        await instances.close()


# -- ghost instances (repairs found in review) -----------------------------------------------------


def _record(iid: int) -> bytes:
    return encode_instance(
        Instance(namespace="ns", component="c", endpoint="e", instance_id=iid, transport="tcp", address="127.0.0.1:1")
    )


async def test_reconcile_drops_a_ghost_only_after_two_reads_and_adds_a_missed_key() -> None:
    store = MemStore()
    await store.start()
    ghost, fresh = instance_key("ns", "c", "e", 1), instance_key("ns", "c", "e", 2)
    view = InstanceSet(store, instances_prefix("ns", "c", "e"))
    # A view that believes in an instance whose key is already gone (its DELETE was never seen).
    await view._map.apply(ghost, _record(1))
    assert await view.reconcile({fresh: _record(2)}) is False  # one read is not enough
    assert [i.instance_id for i in view.instances] == [1]
    assert await view.reconcile({fresh: _record(2)}) is True
    assert [i.instance_id for i in view.instances] == [2]
    assert view.get(1) is None and view.get(2) is not None  # the id index follows
    await store.close()


async def test_a_change_seen_by_only_one_read_is_left_alone() -> None:
    store = MemStore()
    await store.start()
    key = instance_key("ns", "c", "e", 3)
    view = InstanceSet(store, instances_prefix("ns", "c", "e"))
    await view._map.apply(key, _record(3))
    await view.reconcile({})  # a read racing with a fresh PUT
    await view.reconcile({key: _record(3)})
    await view.reconcile({})
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


# -- close keeps the caller's cancellation (repair found in review) --------------------------------


async def test_instance_set_close_keeps_the_callers_cancellation() -> None:
    store = MemStore()
    await store.start()
    for expect_cancel in (True, False):
        view = InstanceSet(store, instances_prefix("ns"))
        await view.start()
        assert view._map._task is not None
        view._map._task.cancel()

        def install(task: asyncio.Task[None], view: InstanceSet = view) -> None:
            view._map._task = task

        await close_check(expect_cancel)(install, view.close)
        assert view._map._task is None and view._map._reconciler is None
    await store.close()
