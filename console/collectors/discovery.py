"""Discovery collector: instances, model cards, the planner's records and the failed workers of
``dynamod up`` supervisors, each prefix a ``WatchedMap``.

The listing first lets the state drop records that vanished while the console was disconnected (one
``reconcile_*`` per kind); the watches then stream changes, and after a gap each map re-lists and
reports what vanished meanwhile. A record that does not decode is noted once in the event log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from dynamod.console.state.failed import parse_failed_key
from dynamod.console.state.recording import StateSink
from dynamod.console.state.scaling import PlannerRecord, decode_planner_record, planner_record_type
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.protocol.keys import PLANNER_ROOT, instances_prefix, mdc_prefix
from dynamod.shared.protocol.model_card import ModelCard, decode_card
from dynamod.shared.protocol.supervisor import SUPERVISOR_ROOT, FailedWorker, failed_prefix
from dynamod.shared.runtime.watched_map import WatchedMap

logger = logging.getLogger(__name__)

NamespaceSeen = Callable[[str], None]


def _decode_failed(_key: str, value: bytes) -> FailedWorker:
    return msgspec.json.decode(value, type=FailedWorker)


def _decode_planner(key: str, value: bytes) -> PlannerRecord:
    record = decode_planner_record(key, value)
    assert record is not None  # the map accepts only keys of a planner record layout
    return record


class DiscoveryCollector:
    """Feeds ``sink`` with every instance, model card and planner record (status, overrides,
    desired/scaled counts) under the namespace (or all of them)."""

    def __init__(
        self,
        store: DiscoveryStore,
        sink: StateSink,
        *,
        namespace: str | None = None,
        on_namespace: NamespaceSeen | None = None,
        on_synced: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._sink = sink
        self._instances_prefix = instances_prefix(namespace)
        self._mdc_prefix = mdc_prefix(namespace)
        self._planner_prefix = f"{PLANNER_ROOT}{namespace}/" if namespace else PLANNER_ROOT
        self._failed_prefix = failed_prefix(namespace) if namespace else SUPERVISOR_ROOT
        self._on_namespace = on_namespace
        self._seen_namespaces: set[str] = set()
        self._on_synced = on_synced

    def _saw(self, inst: Instance) -> None:
        if self._on_namespace is not None and inst.namespace not in self._seen_namespaces:
            self._seen_namespaces.add(inst.namespace)
            self._on_namespace(inst.namespace)

    def _maps(
        self,
    ) -> tuple[WatchedMap[Instance], WatchedMap[ModelCard], WatchedMap[PlannerRecord], WatchedMap[FailedWorker]]:
        def noted(source: str) -> Callable[[str, Exception], None]:
            return lambda key, exc: self._sink.note_decode_error(source, f"{key}: {exc}")

        store = self._store
        return (
            WatchedMap(store, self._instances_prefix, lambda _k, raw: decode_instance(raw),
                       what="instance record", on_invalid=noted("instance record")),
            WatchedMap(store, self._mdc_prefix, lambda _k, raw: decode_card(raw),
                       what="model card", on_invalid=noted("model card")),
            WatchedMap(store, self._planner_prefix, _decode_planner, what="planner record",
                       accepts=lambda key: planner_record_type(key) is not None, on_invalid=noted("planner record")),
            # Restart requests live beside the failed records: the supervisor's business, not the picture's.
            WatchedMap(store, self._failed_prefix, _decode_failed, what="failed-worker record",
                       accepts=lambda key: parse_failed_key(key) is not None, on_invalid=noted("failed-worker record")),
        )

    def _reconcile(self, maps: tuple[WatchedMap, ...]) -> None:
        """Makes the state match the maps as they are now (after their listing)."""
        instances, cards, planner, failed = maps
        for inst in instances.view.values():
            self._saw(inst)
        self._sink.reconcile_instances(dict(instances.view))
        self._sink.reconcile_cards(dict(cards.view))
        self._sink.reconcile_planner(dict(planner.view))
        self._sink.reconcile_failed(dict(failed.view))
        logger.info(
            "discovery synced instances=%d cards=%d planner_records=%d", len(instances), len(cards), len(planner)
        )
        if self._on_synced is not None:
            self._on_synced()

    async def sync(self) -> None:
        """Lists the four prefixes once and reconciles the state with them."""
        maps = self._maps()
        for watched in maps:
            await watched.load()
        self._reconcile(maps)

    async def run(self) -> None:
        """Lists and reconciles, then follows the four prefixes until cancelled or the store closes."""
        maps = self._maps()
        try:
            for watched in maps:
                await watched.start()
            # No await from here on until the listeners are in: no change falls between the two.
            self._reconcile(maps)
            maps[0].add_listener(self._on_instance)
            for watched in maps[1:]:
                watched.add_listener(self._sink.apply_discovery)
            await asyncio.gather(*(watched.ended() for watched in maps))  # until the store closes
        finally:
            await asyncio.gather(*(watched.close() for watched in maps), return_exceptions=True)

    def _on_instance(self, key: str, inst: Instance | None) -> None:
        if inst is not None:
            self._saw(inst)
        self._sink.apply_discovery(key, inst)
