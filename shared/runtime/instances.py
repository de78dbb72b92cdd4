"""A live view of the instances under a discovery prefix, fed by a watch.

Clients, routers and the console all need "which instances serve X right now"; this is the one
place that turns the watch stream into that set, so a new instance shows up within the backend's
watch latency and a removed one is dropped the moment its DELETE arrives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.protocol.instance import Instance, decode_instance

logger = logging.getLogger(__name__)

Listener = Callable[[str, Instance | None], None]
"""Called with (key, instance) on add/update and (key, None) on removal."""


class InstanceSet:
    def __init__(self, store: DiscoveryStore, prefix: str) -> None:
        self._store = store
        self._prefix = prefix
        self._by_key: dict[str, Instance] = {}
        self._listeners: list[Listener] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    async def start(self) -> None:
        if self._task is None:
            # Seed synchronously so callers see the current instances as soon as start() returns.
            for key, value in (await self._store.get_prefix(self._prefix)).items():
                self._apply_put(key, value)
            self._task = asyncio.create_task(self._watch(), name=f"instances-watch:{self._prefix}")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @property
    def instances(self) -> list[Instance]:
        return list(self._by_key.values())

    def get(self, instance_id: int) -> Instance | None:
        for inst in self._by_key.values():
            if inst.instance_id == instance_id:
                return inst
        return None

    async def wait_for(self, predicate: Callable[[list[Instance]], bool], timeout: float) -> list[Instance]:
        """Waits until ``predicate(instances)`` holds; raises TimeoutError after ``timeout``."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self.instances)), timeout)
            return self.instances

    def _apply_put(self, key: str, value: bytes) -> None:
        try:
            inst = decode_instance(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("ignoring malformed instance record key=%s error=%s", key, exc)
            return
        self._by_key[key] = inst
        for listener in self._listeners:
            listener(key, inst)

    def _apply_delete(self, key: str) -> None:
        if self._by_key.pop(key, None) is not None:
            for listener in self._listeners:
                listener(key, None)

    async def _watch(self) -> None:
        async for ev in self._store.watch_prefix(self._prefix):
            if ev.kind is WatchEventKind.PUT and ev.value is not None:
                self._apply_put(ev.key, ev.value)
            else:
                self._apply_delete(ev.key)
            async with self._changed:
                self._changed.notify_all()
