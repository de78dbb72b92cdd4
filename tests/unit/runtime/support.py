"""What the runtime's unit tests share: waiting for a watched set to catch up with a deadline (never a
bare sleep), and one served endpoint on a runtime whose discovery store the test controls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.discovery.mem import MemStore
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.runtime.distributed import DistributedRuntime
from dynamod.shared.transport.plane import RequestContext


async def until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    """Waits for ``predicate()`` (the watch delivers asynchronously); fails after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def served_endpoint(store: MemStore) -> tuple[DistributedRuntime, object]:
    """A runtime on ``store`` serving an echo handler at ns/c/e; returns the runtime and the served
    endpoint (the caller shuts the runtime down)."""
    rt = await DistributedRuntime.create(RuntimeSettings(discovery_backend="mem", event_plane="zmq"), store=store)

    async def handler(body: object, ctx: RequestContext):
        yield body

    served = await rt.namespace("ns").component("c").endpoint("e").serve(handler)
    return rt, served


async def stored_instance(store: MemStore, served) -> Instance | None:
    """The instance record discovery holds for ``served`` (None once it is deregistered)."""
    raw = await store.get(served.key)
    return decode_instance(raw) if raw is not None else None
