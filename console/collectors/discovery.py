"""Discovery collector: instances and model cards, from a listing then a prefix watch.

The listing first (``get_prefix``) lets the state drop records that vanished while the console was
disconnected; the watch then streams changes (the store resumes it across outages on its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from dynamod.console.state.recording import StateSink
from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.protocol.keys import instances_prefix, mdc_prefix
from dynamod.shared.protocol.model_card import ModelCard, decode_card

logger = logging.getLogger(__name__)

NamespaceSeen = Callable[[str], None]


def _decode_instance(key: str, value: bytes, sink: StateSink) -> Instance | None:
    try:
        return decode_instance(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        sink.note_decode_error("instance record", f"{key}: {exc}")
        return None


def _decode_card(key: str, value: bytes, sink: StateSink) -> ModelCard | None:
    try:
        return decode_card(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        sink.note_decode_error("model card", f"{key}: {exc}")
        return None


class DiscoveryCollector:
    """Feeds ``sink`` with every instance and model card under the namespace (or all of them)."""

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
        self._on_namespace = on_namespace
        self._seen_namespaces: set[str] = set()
        self._on_synced = on_synced

    def _saw(self, inst: Instance) -> None:
        if self._on_namespace is not None and inst.namespace not in self._seen_namespaces:
            self._seen_namespaces.add(inst.namespace)
            self._on_namespace(inst.namespace)

    async def sync(self) -> None:
        """Lists both prefixes and reconciles the state with them."""
        live: dict[str, Instance] = {}
        for key, value in (await self._store.get_prefix(self._instances_prefix)).items():
            inst = _decode_instance(key, value, self._sink)
            if inst is not None:
                live[key] = inst
                self._saw(inst)
        cards: dict[str, ModelCard] = {}
        for key, value in (await self._store.get_prefix(self._mdc_prefix)).items():
            card = _decode_card(key, value, self._sink)
            if card is not None:
                cards[key] = card
        self._sink.reconcile_instances(live)
        self._sink.reconcile_cards(cards)
        logger.info("discovery synced instances=%d cards=%d", len(live), len(cards))
        if self._on_synced is not None:
            self._on_synced()

    async def run(self) -> None:
        """Syncs, then watches both prefixes until cancelled."""
        await self.sync()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch(self._instances_prefix, instances=True), name="console-watch-instances")
            tg.create_task(self._watch(self._mdc_prefix, instances=False), name="console-watch-cards")

    async def _watch(self, prefix: str, *, instances: bool) -> None:
        async for ev in self._store.watch_prefix(prefix):
            if ev.kind is WatchEventKind.DELETE or ev.value is None:
                self._sink.apply_discovery(ev.key, None)
                continue
            if instances:
                inst = _decode_instance(ev.key, ev.value, self._sink)
                if inst is not None:
                    self._saw(inst)
                    self._sink.apply_discovery(ev.key, inst)
            else:
                card = _decode_card(ev.key, ev.value, self._sink)
                if card is not None:
                    self._sink.apply_discovery(ev.key, card)
