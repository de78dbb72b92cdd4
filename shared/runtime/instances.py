"""A live view of the instances under a discovery prefix, fed by a watch.

Clients, routers and the console all need "which instances serve X right now"; this is the one
place that turns the watch stream into that set, so a new instance shows up within the backend's
watch latency and a removed one is dropped the moment its DELETE arrives. Instances are indexed by
key and by instance id: the request path looks workers up by id, so that lookup is a dict hit and
callers need no copy of their own.

The set is a ``WatchedMap`` of the prefix (seeded from a listing, then a watch that starts right
after it, re-listed after a failure). A slow reconciliation beside the watch re-reads the prefix
and applies what the watch did not tell (a ghost away, a missed key in); a difference must be seen
by two reads in a row before it is applied, so a read racing with the watch never undoes a fresh
change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.runtime.watched_map import WatchedMap

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
        self._map: WatchedMap[Instance] = WatchedMap(
            store, prefix, lambda _key, raw: decode_instance(raw), what="instance record",
            reconcile_interval_s=reconcile_interval_s,
        )
        self._map.add_listener(self._on_change)
        self._by_key: dict[str, Instance] = {}  # the map's records, kept here to tell who is gone
        self._by_id: dict[int, Instance] = {}
        self._key_of: dict[int, str] = {}  # instance id -> the key its index entry came from
        self._by_id_view: Mapping[int, Instance] = MappingProxyType(self._by_id)
        self._listeners: list[Listener] = []
        self._gone_listeners: list[GoneListener] = []

    async def start(self) -> None:
        """Seeds synchronously (callers see the current instances as soon as it returns), then
        follows the watch."""
        await self._map.start()

    async def close(self) -> None:
        await self._map.close()

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
        await self._map.wait_for(lambda: predicate(self.instances), timeout)
        return self.instances

    async def reconcile(self, live: dict[str, bytes]) -> bool:
        """Applies the differences between ``live`` (a fresh read of the prefix) and this view that
        the previous read showed too; returns whether the view changed."""
        return await self._map.reconcile(live)

    def _on_change(self, key: str, inst: Instance | None) -> None:
        """The map changed ``key``: keeps the index by id, then tells the listeners."""
        if inst is None:
            self._remove(key)
            return
        previous = self._by_key.get(key)
        if previous is not None and previous.instance_id != inst.instance_id:
            self._unindex(key, previous.instance_id)
        self._by_key[key] = inst
        self._by_id[inst.instance_id] = inst
        self._key_of[inst.instance_id] = key
        for listener in self._listeners:
            listener(key, inst)

    def _remove(self, key: str) -> None:
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
