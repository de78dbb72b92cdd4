"""Topology: which instances, workers and model cards discovery shows, and their status changes.

Discovery lists one record per endpoint; an operator thinks in workers (one lease id in one
component), so records are grouped into ``Worker``s and a status change is one event, not nine. A
worker that vanishes stays visible as gone for ``GONE_RETENTION_S`` so the operator sees it leave.
Model cards attach the served model and LoRA adapters to the worker that registered them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dynamod.console.state.event_log import EventLog
from dynamod.console.state.load import LoadTally
from dynamod.console.state.records import (
    EV_DRAIN,
    EV_EXPIRED,
    EV_LORA,
    EV_REGISTERED,
    EV_SLEEP,
    EV_WAKE,
    STATUS_GONE,
    EndpointInstance,
    Worker,
    fmt_id,
)
from dynamod.console.state.versions import Versions
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import INSTANCES_ROOT, MDC_ROOT, parse_key
from dynamod.shared.protocol.model_card import ModelCard

GONE_RETENTION_S = 60.0  # a vanished worker stays visible as "gone" this long

CardEntry = tuple[str, str, int, ModelCard]  # (namespace, component, instance id, card)


class Topology:
    """Instances by discovery key, workers by (namespace, component, id), cards by key."""

    def __init__(self, clock: Callable[[], float], versions: Versions, log: EventLog, load: LoadTally) -> None:
        self._clock = clock
        self._versions = versions
        self._log = log
        self._load = load
        self.instances: dict[str, EndpointInstance] = {}
        self.workers: dict[tuple[str, str, int], Worker] = {}
        self.cards: dict[str, CardEntry] = {}

    # -- instances --------------------------------------------------------------------------------

    def put_instance(self, key: str, inst: Instance) -> None:
        now = self._clock()
        existing = self.instances.get(key)
        if existing is not None and existing.gone_at is None and existing.record == inst:
            return
        entry = EndpointInstance(key, inst)
        self.instances[key] = entry
        wkey = (inst.namespace, inst.component, inst.instance_id)
        worker = self.workers.get(wkey)
        if worker is None:
            worker = Worker(inst.namespace, inst.component, inst.instance_id, first_seen=now)
            worker.stats = self._load.stats_for(inst.instance_id)
            self.workers[wkey] = worker
        was_gone = worker.gone_at is not None or not worker.endpoints
        worker.endpoints[inst.endpoint] = entry
        worker.gone_at = None
        old_status = worker.status
        worker.status = worker.derive_status()
        self._versions.topology += 1
        if was_gone:
            self._emit_registered(worker)
        elif old_status != worker.status:
            self._emit_status_change(worker, old_status)

    def delete_instance(self, key: str) -> None:
        entry = self.instances.get(key)
        if entry is None or entry.gone_at is not None:
            return
        now = self._clock()
        entry.gone_at = now
        rec = entry.record
        worker = self.workers.get((rec.namespace, rec.component, rec.instance_id))
        self._versions.topology += 1
        if worker is None:
            return
        if all(e.gone_at is not None for e in worker.endpoints.values()):
            before = worker.status
            worker.gone_at = now
            worker.status = STATUS_GONE
            self._load.worker_gone(worker)
            what = "worker" if worker.is_worker else worker.component
            reason = "after draining" if before == "draining" else "(deregistered or lease expired)"
            self._log.add_about(
                worker, EV_EXPIRED, f"{what} {worker.id_hex} gone {reason}",
                severity="info" if before == "draining" else "warning",
            )

    def reconcile_instances(self, live: Mapping[str, Instance]) -> None:
        """Makes the picture match a fresh listing (after a reconnect): puts every live record and
        marks every known key absent from it as gone."""
        for key, inst in live.items():
            self.put_instance(key, inst)
        for key, entry in list(self.instances.items()):
            if key not in live and entry.gone_at is None:
                self.delete_instance(key)

    def _emit_registered(self, worker: Worker) -> None:
        what = "worker" if worker.is_worker else worker.component
        model = f" model={worker.model}" if worker.model else ""
        node = f" node={worker.node}" if worker.node else ""
        role = f" role={worker.role}" if worker.role else ""
        self._log.add_about(worker, EV_REGISTERED, f"{what} {worker.id_hex} registered{role}{model}{node}")

    def _emit_status_change(self, worker: Worker, old: str) -> None:
        new = worker.status
        if new == "draining":
            kind, msg, sev = EV_DRAIN, "draining: takes no new requests", "warning"
        elif new == "sleeping":
            kind, msg, sev = EV_SLEEP, "sleeping: engine memory released", "warning"
        elif new == "ready" and old == "sleeping":
            kind, msg, sev = EV_WAKE, "woke up: ready", "info"
        else:
            kind, msg, sev = EV_WAKE if new == "ready" else EV_DRAIN, f"status {old} -> {new}", "info"
        self._log.add_about(worker, kind, f"worker {worker.id_hex} {msg}", severity=sev)

    # -- model cards ------------------------------------------------------------------------------

    def put_card(self, key: str, card: ModelCard) -> None:
        parsed = parse_key(key)
        if parsed is None or not key.startswith(MDC_ROOT):
            return
        old = self.cards.get(key)
        if old is not None and old[3] == card:
            return
        self.cards[key] = (parsed.namespace, parsed.component, parsed.instance_id, card)
        self._versions.topology += 1
        worker = self.worker_for(parsed.namespace, parsed.component, parsed.instance_id)
        if card.lora or parsed.lora:
            name = card.lora or parsed.lora or card.served_model_name
            if worker is not None:
                worker.loras[name] = card.base_model or ""
            if old is None:
                self._log.add_about(
                    parsed, EV_LORA, f"LoRA {name} loaded on {fmt_id(parsed.instance_id)} (base {card.base_model or '?'})"
                )
        elif worker is not None:
            worker.card_model = card.served_model_name

    def delete_card(self, key: str) -> None:
        old = self.cards.pop(key, None)
        if old is None:
            return
        ns, component, iid, card = old
        self._versions.topology += 1
        name = card.lora
        if name:
            worker = self.worker_for(ns, component, iid)
            if worker is not None:
                worker.loras.pop(name, None)
            if worker is None or worker.gone_at is None:
                self._log.add(
                    EV_LORA,
                    f"LoRA {name} unloaded from {fmt_id(iid)}",
                    namespace=ns,
                    component=component,
                    instance_id=iid,
                )

    def reconcile_cards(self, live: Mapping[str, ModelCard]) -> None:
        """Like ``reconcile_instances`` for model cards."""
        for key, card in live.items():
            self.put_card(key, card)
        for key in [k for k in self.cards if k not in live]:
            self.delete_card(key)

    def apply_discovery(self, key: str, value: Instance | ModelCard | None) -> None:
        """One discovery watch event: a put (decoded record) or a delete (None)."""
        if key.startswith(INSTANCES_ROOT):
            if value is None:
                self.delete_instance(key)
            elif isinstance(value, Instance):
                self.put_instance(key, value)
        elif key.startswith(MDC_ROOT):
            if value is None:
                self.delete_card(key)
            elif isinstance(value, ModelCard):
                self.put_card(key, value)

    # -- lookups ----------------------------------------------------------------------------------

    def worker_for(self, namespace: str, component: str, iid: int) -> Worker | None:
        """The worker a card (or other record keyed by component) belongs to."""
        worker = self.workers.get((namespace, component, iid))
        if worker is not None:
            return worker
        # Cards live under the generate endpoint's component, which is the worker's component.
        for w in self.workers.values():
            if w.instance_id == iid and w.namespace == namespace:
                return w
        return None

    def first_worker(self, instance_id: int) -> Worker | None:
        """The first worker known under ``instance_id``, gone or not (to label an event with its
        namespace and component)."""
        return next((w for w in self.workers.values() if w.instance_id == instance_id), None)

    def find_worker(self, instance_id: int) -> Worker | None:
        """The worker under ``instance_id``, a live one before a gone one."""
        best: Worker | None = None
        for w in self.workers.values():
            if w.instance_id == instance_id and (best is None or (best.gone_at is not None and w.gone_at is None)):
                best = w
        return best

    def worker_list(self, *, workers_only: bool = True, include_gone: bool = True) -> list[Worker]:
        out = [
            w
            for w in self.workers.values()
            if (not workers_only or w.is_worker) and (include_gone or w.gone_at is None)
        ]
        out.sort(key=lambda w: (w.namespace, w.component, w.instance_id))
        return out

    def live_ids(self) -> set[int]:
        """Instance ids of every worker still shown (gone ones included until pruned)."""
        return {w.instance_id for w in self.workers.values()}

    def namespaces(self) -> list[str]:
        return sorted({w.namespace for w in self.workers.values()})

    # -- upkeep -----------------------------------------------------------------------------------

    def prune(self, now: float) -> None:
        """Forgets workers and instance records gone for longer than ``GONE_RETENTION_S``."""
        pruned = False
        for wkey, worker in list(self.workers.items()):
            if worker.gone_at is not None and now - worker.gone_at > GONE_RETENTION_S:
                del self.workers[wkey]
                for entry in worker.endpoints.values():
                    if self.instances.get(entry.key) is entry:
                        del self.instances[entry.key]
                pruned = True
        for key, entry in list(self.instances.items()):
            if entry.gone_at is not None and now - entry.gone_at > GONE_RETENTION_S:
                del self.instances[key]
                pruned = True
        if pruned:
            self._versions.topology += 1
