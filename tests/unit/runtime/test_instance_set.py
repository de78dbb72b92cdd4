"""InstanceSet's index by instance id: lookups by id follow puts, replacements and deletes."""

from __future__ import annotations

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.instance import Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key, instances_prefix
from dynamod.shared.runtime.instances import InstanceSet
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
