"""Discovery collector: instances, model cards, the planner's records and the failed workers of
``dynamod up`` supervisors, from a listing then a prefix watch.

The listing first (``get_prefix``) lets the state drop records that vanished while the console was
disconnected; the watch then streams changes (the store resumes it across outages on its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from dynamod.console.state.failed import parse_failed_key
from dynamod.console.state.recording import StateSink
from dynamod.console.state.scaling import PlannerRecord, decode_planner_record
from dynamod.shared.discovery.store import DiscoveryStore, WatchEventKind
from dynamod.shared.protocol.instance import Instance, decode_instance
from dynamod.shared.protocol.keys import PLANNER_ROOT, instances_prefix, mdc_prefix
from dynamod.shared.protocol.model_card import ModelCard, decode_card
from dynamod.shared.protocol.supervisor import SUPERVISOR_ROOT, FailedWorker, failed_prefix

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


def _decode_failed(key: str, value: bytes, sink: StateSink) -> FailedWorker | None:
    if parse_failed_key(key) is None:
        return None  # a restart request: the supervisor's business, not the picture's
    try:
        return msgspec.json.decode(value, type=FailedWorker)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        sink.note_decode_error("failed-worker record", f"{key}: {exc}")
        return None


def _decode_planner(key: str, value: bytes, sink: StateSink) -> PlannerRecord | None:
    try:
        return decode_planner_record(key, value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        sink.note_decode_error("planner record", f"{key}: {exc}")
        return None


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
        planner: dict[str, PlannerRecord] = {}
        for key, value in (await self._store.get_prefix(self._planner_prefix)).items():
            record = _decode_planner(key, value, self._sink)
            if record is not None:
                planner[key] = record
        failed: dict[str, FailedWorker] = {}
        for key, value in (await self._store.get_prefix(self._failed_prefix)).items():
            gave_up = _decode_failed(key, value, self._sink)
            if gave_up is not None:
                failed[key] = gave_up
        self._sink.reconcile_instances(live)
        self._sink.reconcile_cards(cards)
        self._sink.reconcile_planner(planner)
        self._sink.reconcile_failed(failed)
        logger.info("discovery synced instances=%d cards=%d planner_records=%d", len(live), len(cards), len(planner))
        if self._on_synced is not None:
            self._on_synced()

    async def run(self) -> None:
        """Syncs, then watches the four prefixes until cancelled."""
        await self.sync()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch(self._instances_prefix, "instances"), name="console-watch-instances")
            tg.create_task(self._watch(self._mdc_prefix, "cards"), name="console-watch-cards")
            tg.create_task(self._watch(self._planner_prefix, "planner"), name="console-watch-planner")
            tg.create_task(self._watch(self._failed_prefix, "failed"), name="console-watch-failed")

    async def _watch(self, prefix: str, what: str) -> None:
        async for ev in self._store.watch_prefix(prefix):
            if ev.kind is WatchEventKind.DELETE or ev.value is None:
                if what != "failed" or parse_failed_key(ev.key) is not None:
                    self._sink.apply_discovery(ev.key, None)
                continue
            if what == "instances":
                inst = _decode_instance(ev.key, ev.value, self._sink)
                if inst is not None:
                    self._saw(inst)
                    self._sink.apply_discovery(ev.key, inst)
            elif what == "cards":
                card = _decode_card(ev.key, ev.value, self._sink)
                if card is not None:
                    self._sink.apply_discovery(ev.key, card)
            elif what == "failed":
                failed = _decode_failed(ev.key, ev.value, self._sink)
                if failed is not None:
                    self._sink.apply_discovery(ev.key, failed)
            else:
                record = _decode_planner(ev.key, ev.value, self._sink)
                if record is not None:
                    self._sink.apply_discovery(ev.key, record)
