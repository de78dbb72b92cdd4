"""A live view of the instances under a discovery prefix, fed by a watch.

Clients, routers and the console all need "which instances serve X right now"; this is the one
place that turns the watch stream into that set, so a new instance shows up within the backend's
watch latency and a removed one is dropped the moment its DELETE arrives.

A slow reconciliation beside the watch re-reads the prefix and repairs what a watch cannot tell:
a key deleted between the initial read and the watch's start never produces a DELETE, and its
instance id is never reused, so without it a dead instance would be listed (and routed to) forever.
A difference must be seen by two reads in a row before it is applied, so a read racing with the
watch never undoes a fresh change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.instance import Instance, decode_instance

logger = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 5.0

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
        self._reconciler: asyncio.Task[None] | None = None
        self._suspect_gone: set[str] = set()
        self._suspect_new: set[str] = set()

    async def start(self) -> None:
        if self._task is None:
            # Seed synchronously so callers see the current instances as soon as start() returns.
            for key, value in (await self._store.get_prefix(self._prefix)).items():
                self._apply_put(key, value)
            self._task = asyncio.create_task(self._watch(), name=f"instances-watch:{self._prefix}")
            self._reconciler = asyncio.create_task(self._reconcile_loop(), name=f"instances-reconcile:{self._prefix}")

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._reconciler) if t is not None]
        for task in tasks:
            task.cancel()
        # gather with return_exceptions collects the tasks' own cancellation without swallowing
        # a cancellation of the caller, which still propagates from this await.
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._reconciler = None

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

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            try:
                live = await self._store.get_prefix(self._prefix)
            except DynamoError as exc:  # discovery briefly unreachable: the watch reconnects itself
                logger.debug("instance reconcile skipped prefix=%s error=%s", self._prefix, exc)
                continue
            self.reconcile(live)

    def reconcile(self, live: dict[str, bytes]) -> None:
        """Applies differences between ``live`` (a fresh read) and this view that a previous read
        also showed."""
        gone = {k for k in self._by_key if k not in live}
        new = {k for k in live if k not in self._by_key}
        for key in gone & self._suspect_gone:
            logger.info("instance reconciled away key=%s", key)
            self._apply_delete(key)
        for key in new & self._suspect_new:
            self._apply_put(key, live[key])
        self._suspect_gone = gone - self._suspect_gone
        self._suspect_new = new - self._suspect_new

    async def _watch(self) -> None:
        async for ev in self._store.watch_prefix(self._prefix):
            if ev.kind is WatchEventKind.PUT and ev.value is not None:
                self._apply_put(ev.key, ev.value)
            else:
                self._apply_delete(ev.key)
            async with self._changed:
                self._changed.notify_all()
