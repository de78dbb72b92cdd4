"""Runtime repairs on a real etcd: a lease's revoke and the store's close keep their caller's
cancellation, and an instance deleted between the instance view's seed read and its watch leaves
the view. (The other backends: tests/unit/discovery/test_discovery_file_close.py and
tests/unit/runtime/test_instance_set.py.)"""

from __future__ import annotations

import asyncio

import pytest

from dynamod.shared.discovery.etcd import EtcdStore
from dynamod.shared.protocol.instance import Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key, instances_prefix
from dynamod.shared.runtime.instances import InstanceSet
from tests.fixtures.cancellation import close_check
from tests.fixtures.discovery_faults import delete_before_watch
from tests.fixtures.servers import EtcdServer


@pytest.mark.parametrize(
    ("expect_cancel", "via_close"), [(True, False), (True, True), (False, False), (False, True)]
)
async def test_etcd_lease_revoke_and_close_keep_the_callers_cancellation(
    etcd_server: EtcdServer, expect_cancel: bool, via_close: bool
) -> None:
    store = EtcdStore([etcd_server.endpoint])
    await store.start()
    try:
        lease = await store.create_lease(5)
        assert lease.task is not None
        lease.task.cancel()

        def install(task: asyncio.Task[None]) -> None:
            lease.task = task

        await close_check(expect_cancel)(install, store.close if via_close else lease.revoke)
    finally:
        await store.close()


async def test_etcd_instance_deleted_between_seed_and_watch_leaves_the_view(etcd_server: EtcdServer) -> None:
    store = EtcdStore([etcd_server.endpoint])
    await store.start()
    ghost_key, live_key = instance_key("ns", "c", "e", 1), instance_key("ns", "c", "e", 2)
    for iid, key in ((1, ghost_key), (2, live_key)):
        record = Instance(namespace="ns", component="c", endpoint="e", instance_id=iid, transport="tcp", address="x:1")
        await store.put(key, encode_instance(record))
    delete_before_watch(store, ghost_key)
    view = InstanceSet(store, instances_prefix("ns", "c", "e"), reconcile_interval_s=0.05)
    await view.start()
    try:
        assert sorted(i.instance_id for i in view.instances) == [1, 2]
        await view.wait_for(lambda insts: [i.instance_id for i in insts] == [2], timeout=5)
    finally:
        await view.close()
        await store.close()
