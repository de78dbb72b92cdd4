"""Repairs the runtime makes on its own: an instance view healed by reconciliation, and a busy
status port reported as a one-line configuration error with nothing left running."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.errors import ConfigError
from dynamod.shared.protocol.instance import Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key, instances_prefix
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.runtime.instances import InstanceSet


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
    view._apply_put(ghost, _record(1))
    view.reconcile({fresh: _record(2)})
    assert [i.instance_id for i in view.instances] == [1]  # one read is not enough
    view.reconcile({fresh: _record(2)})
    assert [i.instance_id for i in view.instances] == [2]
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


async def test_busy_status_port_is_a_config_error_and_releases_everything(tmp_path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    store = MemStore()
    settings = RuntimeSettings(discovery_backend="mem", event_plane="zmq", system_port=port)
    try:
        with pytest.raises(ConfigError, match="--system-port"):
            await DistributedRuntime.create(settings, store=store)
        assert await store.get_prefix("") == {}
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        assert leftover == []
    finally:
        holder.close()
