"""EndpointPool reads its client's instance set (no copy of its own) and lets a restarted or
departed worker out of the quarantine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dynamod.daemon.frontend.pipeline.models import EndpointPool
from dynamod.daemon.frontend.pipeline.routing import Quarantine
from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.protocol.instance import Instance, encode_instance
from dynamod.shared.protocol.keys import instance_key
from dynamod.shared.runtime.client import EndpointClient
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.unit.runtime.support import until

WID = 0x51


def record(started_at: float = 1.0, address: str = "127.0.0.1:9000", status: str = "ready") -> Instance:
    return Instance(
        namespace="dynamo", component="backend", endpoint="generate", instance_id=WID, transport="tcp",
        address=address, status=status, started_at=started_at,
    )


@pytest.fixture
async def parts() -> AsyncIterator[tuple[MemStore, EndpointClient]]:
    store = MemStore()
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq"), store=store, events=False)
    await store.put(instance_key("dynamo", "backend", "generate", WID), encode_instance(record()))
    client = await rt.namespace().component("backend").endpoint("generate").client()
    yield store, client
    await client.close()
    await rt.shutdown()


async def put(store: MemStore, inst: Instance) -> None:
    await store.put(instance_key("dynamo", "backend", "generate", WID), encode_instance(inst))


async def test_instances_follow_the_instance_set(parts: tuple[MemStore, EndpointClient]) -> None:
    store, client = parts
    changes: list[int] = []
    pool = EndpointPool(client, lambda: changes.append(1), Quarantine(hold_s=60.0))
    assert pool.instances is client.instance_set.by_id
    assert pool.instances[WID] == record()
    await put(store, record(status="draining"))
    await until(lambda: pool.instances[WID].status == "draining")
    assert changes


async def test_quarantine_kept_on_update_dropped_on_restart_and_on_removal(parts: tuple[MemStore, EndpointClient]) -> None:
    store, client = parts
    quarantine = Quarantine(hold_s=60.0)
    EndpointPool(client, lambda: None, quarantine)
    quarantine.add(WID)
    await put(store, record(status="draining"))  # the same run, another status
    await until(lambda: client.instance_set.get(WID).status == "draining")
    assert WID in quarantine
    await put(store, record(started_at=2.0))  # restarted under the same id: a fresh chance
    await until(lambda: WID not in quarantine)
    quarantine.add(WID)
    await put(store, record(started_at=2.0, address="127.0.0.1:9001"))  # moved: also a new run
    await until(lambda: WID not in quarantine)
    quarantine.add(WID)
    await store.delete(instance_key("dynamo", "backend", "generate", WID))
    await until(lambda: WID not in quarantine)
    assert client.instance_set.get(WID) is None
