"""A live view of the instances under a discovery prefix, fed by a watch.

Clients, routers and the console all need "which instances serve X right now"; this is the one
place that turns the watch stream into that set, so a new instance shows up within the backend's
watch latency and a removed one is dropped the moment its DELETE arrives. Instances are indexed by
key and by instance id: the request path looks workers up by id, so that lookup is a dict hit and
callers need no copy of their own.

The set is seeded from ``get_prefix`` and then follows a watch, and a key deleted between the two
reads never produces a DELETE (the watch's snapshot simply lacks it; instance ids are never reused),
so without repair a dead instance would be listed, and routed to, for ever. A slow reconciliation
beside the watch re-reads the prefix and applies what the watch cannot tell (a ghost away, a missed
key in). A difference must be seen by two reads in a row before it is applied, so a read racing
with the watch never undoes a fresh change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType

import msgspec

from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.errors import DynamoError
from dynamod.shared.protocol.instance import Instance, decode_instance

logger = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 5.0

Listener = Callable[[str, Instance | None], None]
"""Called with (key, instance) on add/update and (key, None) on removal."""

GoneListener = Callable[[Instance], None]
"""Called with the instance when its id is no longer served under the prefix (its record was
deleted or its lease ended). A status change (``draining``) is an update, never a removal."""


class InstanceSet:
    def __init__(
        self, store: DiscoveryStore, prefix: str, *, reconcile_interval_s: float = RECONCILE_INTERVAL_S
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._by_key: dict[str, Instance] = {}
        self._by_id: dict[int, Instance] = {}
        self._key_of: dict[int, str] = {}  # instance id -> the key its index entry came from
        self._by_id_view: Mapping[int, Instance] = MappingProxyType(self._by_id)
        self._listeners: list[Listener] = []
        self._gone_listeners: list[GoneListener] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._reconciler: asyncio.Task[None] | None = None
        self._reconcile_interval_s = reconcile_interval_s
        self._suspect_gone: set[str] = set()  # differences the previous read showed
        self._suspect_new: set[str] = set()

    async def start(self) -> None:
        if self._task is None:
            # Seed synchronously so callers see the current instances as soon as start() returns.
            for key, value in (await self._store.get_prefix(self._prefix)).items():
                self._apply_put(key, value)
            self._task = asyncio.create_task(self._watch(), name=f"instances-watch:{self._prefix}")
            self._reconciler = asyncio.create_task(
                self._reconcile_loop(), name=f"instances-reconcile:{self._prefix}"
            )

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._reconciler) if t is not None]
        self._task = self._reconciler = None
        for task in tasks:
            task.cancel()
        # gather(return_exceptions=True) absorbs the tasks' own cancellation only: if the caller
        # is cancelled while waiting here, gather raises CancelledError and it propagates.
        await asyncio.gather(*tasks, return_exceptions=True)

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def add_gone_listener(self, listener: GoneListener) -> None:
        """``listener(instance)`` runs when an instance id leaves the set (see ``GoneListener``)."""
        self._gone_listeners.append(listener)

    @property
    def instances(self) -> list[Instance]:
        return list(self._by_key.values())

    @property
    def by_id(self) -> Mapping[int, Instance]:
        """The live instances by instance id: a read-only view that follows the watch (the same
        object every time, so a caller may keep it)."""
        return self._by_id_view

    def get(self, instance_id: int) -> Instance | None:
        return self._by_id.get(instance_id)

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
        previous = self._by_key.get(key)
        if previous is not None and previous.instance_id != inst.instance_id:
            self._unindex(key, previous.instance_id)
        self._by_key[key] = inst
        self._by_id[inst.instance_id] = inst
        self._key_of[inst.instance_id] = key
        for listener in self._listeners:
            listener(key, inst)

    def _apply_delete(self, key: str) -> None:
        inst = self._by_key.pop(key, None)
        if inst is not None:
            self._unindex(key, inst.instance_id)
            for listener in self._listeners:
                listener(key, None)
            if inst.instance_id not in self._by_id:
                for gone in self._gone_listeners:
                    gone(inst)

    def _unindex(self, key: str, instance_id: int) -> None:
        """Drops the id entry ``key`` put there; another key holding the same id (a wider prefix:
        one worker on several endpoints) takes its place."""
        if self._key_of.get(instance_id) != key:
            return
        del self._key_of[instance_id]
        del self._by_id[instance_id]
        for other_key, other in self._by_key.items():
            if other.instance_id == instance_id:
                self._by_id[instance_id] = other
                self._key_of[instance_id] = other_key
                return

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._reconcile_interval_s)
            try:
                live = await self._store.get_prefix(self._prefix)
            except DynamoError as exc:  # discovery briefly unreachable: the watch resumes by itself
                logger.debug("instance reconcile skipped prefix=%s error=%s", self._prefix, exc)
                continue
            if self.reconcile(live):
                async with self._changed:
                    self._changed.notify_all()

    def reconcile(self, live: dict[str, bytes]) -> bool:
        """Applies the differences between ``live`` (a fresh read of the prefix) and this view that
        the previous read showed too; returns whether the view changed."""
        gone = {k for k in self._by_key if k not in live}
        new = {k for k in live if k not in self._by_key}
        changed = False
        for key in sorted(gone & self._suspect_gone):
            logger.info("instance reconciled away (its DELETE was never seen) key=%s", key)
            self._apply_delete(key)
            changed = True
        for key in sorted(new & self._suspect_new):
            logger.info("instance reconciled in (its PUT was never seen) key=%s", key)
            self._apply_put(key, live[key])
            changed = True
        self._suspect_gone = gone - self._suspect_gone
        self._suspect_new = new - self._suspect_new
        return changed

    async def _watch(self) -> None:
        async for ev in self._store.watch_prefix(self._prefix):
            if ev.kind is WatchEventKind.PUT and ev.value is not None:
                self._apply_put(ev.key, ev.value)
            else:
                self._apply_delete(ev.key)
            async with self._changed:
                self._changed.notify_all()
