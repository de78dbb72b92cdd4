"""Recorded collector streams: write what the collectors saw as JSON lines, replay it into a state.

One line per input, with the wall time it arrived (``t``) and its ``kind``::

    {"t": 1700000000.1, "kind": "put", "key": "v1/instances/...", "value": {...instance...}}
    {"t": ..., "kind": "delete", "key": "v1/mdc/..."}
    {"t": ..., "kind": "kv_metrics", "namespace": "dynamo", "value": {...LoadMetrics...}}
    {"t": ..., "kind": "kv_event", "namespace": "dynamo", "value": {...RouterEvent...}}
    {"t": ..., "kind": "kv_seed", "worker_id": 123, "blocks": 812, "event_id": 4410}
    {"t": ..., "kind": "put", "key": "v1/planner/dynamo/status", "value": {...PlannerStatus...}}
    {"t": ..., "kind": "reconcile_planner", "value": {"v1/planner/...": {...}, ...}}
    {"t": ..., "kind": "reconcile_failed", "value": {"v1/supervisor/dynamo/failed/worker-1": {...}}}
    {"t": ..., "kind": "router_decision", "namespace": "dynamo", "value": {...PublishedDecision...}}
    {"t": ..., "kind": "planner_decision", "namespace": "dynamo", "value": {...PlannerDecision...}}
    {"t": ..., "kind": "metrics", "source": "http://...", "text": "...prometheus text..."}
    {"t": ..., "kind": "scrape_failed", "source": "http://...", "reason": "401 from ...: give ..."}
    {"t": ..., "kind": "connection", "name": "discovery", "state": "ok", "target": "...", "detail": ""}
    {"t": ..., "kind": "tick"}

``dynamoctl watch --raw`` prints exactly these lines, so a live cluster can be recorded and replayed
in a unit test or a snapshot test with the same clock it was recorded with. A planner decision of
another shape (recordings made before ``PlannerDecision`` was fixed) replays as a decode error, the
way a live console shows a message it cannot read, rather than stopping the replay; so does a router
decision that is not a ``PublishedDecision``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import msgspec

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.decisions import HeardDecision, convert_router_decision
from dynamod.console.state.scaling import PlannerRecord, convert_planner_record
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import INSTANCES_ROOT, MDC_ROOT, PLANNER_ROOT
from dynamod.shared.protocol.kv_events import RouterEvent
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.model_card import ModelCard
from dynamod.shared.protocol.planner import PlannerDecision
from dynamod.shared.protocol.supervisor import SUPERVISOR_ROOT, FailedWorker


class StateSink(Protocol):
    """What collectors feed. ``ClusterState`` is one; ``RecordingSink`` records and forwards."""

    def apply_discovery(self, key: str, value: Instance | ModelCard | PlannerRecord | FailedWorker | None) -> None: ...
    def reconcile_instances(self, live: Mapping[str, Instance]) -> None: ...
    def reconcile_cards(self, live: Mapping[str, ModelCard]) -> None: ...
    def reconcile_planner(self, live: Mapping[str, PlannerRecord]) -> None: ...
    def reconcile_failed(self, live: Mapping[str, FailedWorker]) -> None: ...
    def apply_load(self, m: LoadMetrics) -> None: ...
    def apply_kv_event(self, ev: RouterEvent) -> None: ...
    def apply_kv_seed(self, worker_id: int, blocks: int, event_id: int) -> None: ...
    def apply_router_decision(self, namespace: str, decision: HeardDecision) -> Any: ...
    def apply_planner_decision(self, namespace: str, decision: PlannerDecision) -> None: ...
    def apply_metrics_text(self, source: str, text: str) -> None: ...
    def forget_source(self, source: str) -> None: ...
    def scrape_failed(self, source: str, reason: str) -> None: ...
    def set_connection(self, name: str, state: str, target: str = "", detail: str = "") -> None: ...
    def note_decode_error(self, source: str, detail: str) -> None: ...
    def tick(self) -> None: ...


class ManualClock:
    """A clock a replay (or a test) moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


class RecordingSink:
    """Forwards every input to a ``ClusterState`` and writes it as one JSON line to ``write``."""

    def __init__(self, state: ClusterState, write: Callable[[str], None], *, record_metrics: bool = True) -> None:
        self.state = state
        self._write = write
        self._record_metrics = record_metrics

    def _emit(self, kind: str, **fields: Any) -> None:
        line = {"t": round(self.state.clock(), 6), "kind": kind, **fields}
        self._write(json.dumps(line, separators=(",", ":"), default=str) + "\n")

    def apply_discovery(self, key: str, value: Instance | ModelCard | PlannerRecord | FailedWorker | None) -> None:
        if value is None:
            self._emit("delete", key=key)
        else:
            self._emit("put", key=key, value=_builtins(value))
        self.state.apply_discovery(key, value)

    def reconcile_instances(self, live: Mapping[str, Instance]) -> None:
        self._emit("reconcile", value={k: _builtins(v) for k, v in live.items()})
        self.state.reconcile_instances(live)

    def reconcile_cards(self, live: Mapping[str, ModelCard]) -> None:
        self._emit("reconcile_cards", value={k: _builtins(v) for k, v in live.items()})
        self.state.reconcile_cards(live)

    def reconcile_planner(self, live: Mapping[str, PlannerRecord]) -> None:
        self._emit("reconcile_planner", value={k: _builtins(v) for k, v in live.items()})
        self.state.reconcile_planner(live)

    def reconcile_failed(self, live: Mapping[str, FailedWorker]) -> None:
        self._emit("reconcile_failed", value={k: _builtins(v) for k, v in live.items()})
        self.state.reconcile_failed(live)

    def apply_load(self, m: LoadMetrics) -> None:
        if self._record_metrics:
            self._emit("kv_metrics", value=_builtins(m))
        self.state.apply_load(m)

    def apply_kv_event(self, ev: RouterEvent) -> None:
        self._emit("kv_event", value=_builtins(ev))
        self.state.apply_kv_event(ev)

    def apply_kv_seed(self, worker_id: int, blocks: int, event_id: int) -> None:
        self._emit("kv_seed", worker_id=worker_id, blocks=blocks, event_id=event_id)
        self.state.apply_kv_seed(worker_id, blocks, event_id)

    def apply_router_decision(self, namespace: str, decision: HeardDecision) -> Any:
        self._emit("router_decision", namespace=namespace, value=_builtins(decision))
        return self.state.apply_router_decision(namespace, decision)

    def apply_planner_decision(self, namespace: str, decision: PlannerDecision) -> None:
        self._emit("planner_decision", namespace=namespace, value=_builtins(decision))
        self.state.apply_planner_decision(namespace, decision)

    def apply_metrics_text(self, source: str, text: str) -> None:
        self._emit("metrics", source=source, text=text)
        self.state.apply_metrics_text(source, text)

    def forget_source(self, source: str) -> None:
        self._emit("forget_source", source=source)
        self.state.forget_source(source)

    def scrape_failed(self, source: str, reason: str) -> None:
        self._emit("scrape_failed", source=source, reason=reason)
        self.state.scrape_failed(source, reason)

    def set_connection(self, name: str, state: str, target: str = "", detail: str = "") -> None:
        self._emit("connection", name=name, state=state, target=target, detail=detail)
        self.state.set_connection(name, state, target, detail)

    def note_decode_error(self, source: str, detail: str) -> None:
        self._emit("decode_error", source=source, detail=detail)
        self.state.note_decode_error(source, detail)

    def tick(self) -> None:
        self._emit("tick")
        self.state.tick()


def decode_discovery_value(key: str, value: Any) -> Instance | ModelCard | PlannerRecord | FailedWorker | None:
    if value is None:
        return None
    if key.startswith(INSTANCES_ROOT):
        return msgspec.convert(value, Instance)
    if key.startswith(MDC_ROOT):
        return msgspec.convert(value, ModelCard)
    if key.startswith(PLANNER_ROOT):
        return convert_planner_record(key, value)
    if key.startswith(SUPERVISOR_ROOT):
        return msgspec.convert(value, FailedWorker)
    return None


def apply_record(state: ClusterState, rec: Mapping[str, Any]) -> None:
    """Applies one recorded line to ``state`` (its clock must already read ``rec['t']``)."""
    kind = rec["kind"]
    if kind == "put":
        state.apply_discovery(rec["key"], decode_discovery_value(rec["key"], rec["value"]))
    elif kind == "delete":
        state.apply_discovery(rec["key"], None)
    elif kind == "reconcile":
        state.reconcile_instances({k: msgspec.convert(v, Instance) for k, v in rec["value"].items()})
    elif kind == "reconcile_cards":
        state.reconcile_cards({k: msgspec.convert(v, ModelCard) for k, v in rec["value"].items()})
    elif kind == "reconcile_planner":
        live = {k: convert_planner_record(k, v) for k, v in rec["value"].items()}
        state.reconcile_planner({k: v for k, v in live.items() if v is not None})
    elif kind == "reconcile_failed":
        state.reconcile_failed({k: msgspec.convert(v, FailedWorker) for k, v in rec["value"].items()})
    elif kind == "kv_metrics":
        state.apply_load(msgspec.convert(rec["value"], LoadMetrics))
    elif kind == "kv_event":
        state.apply_kv_event(msgspec.convert(rec["value"], RouterEvent))
    elif kind == "kv_seed":
        state.apply_kv_seed(int(rec["worker_id"]), int(rec["blocks"]), int(rec["event_id"]))
    elif kind == "router_decision":
        try:
            heard = convert_router_decision(rec["value"])
        except msgspec.ValidationError as exc:
            state.note_decode_error("router_decisions", str(exc))
        else:
            state.apply_router_decision(rec.get("namespace", ""), heard)
    elif kind == "planner_decision":
        try:
            decision = msgspec.convert(rec["value"], PlannerDecision)
        except msgspec.ValidationError as exc:
            state.note_decode_error("planner_decisions", str(exc))
        else:
            state.apply_planner_decision(rec.get("namespace", ""), decision)
    elif kind == "metrics":
        state.apply_metrics_text(rec["source"], rec["text"])
    elif kind == "forget_source":
        state.forget_source(rec["source"])
    elif kind == "scrape_failed":
        state.scrape_failed(rec["source"], rec["reason"])
    elif kind == "connection":
        state.set_connection(rec["name"], rec["state"], rec.get("target", ""), rec.get("detail", ""))
    elif kind == "decode_error":
        state.note_decode_error(rec["source"], rec["detail"])
    elif kind == "action":
        state.record_action(rec["action"], rec["target"], bool(rec["ok"]), rec["message"])
    elif kind == "tick":
        state.tick()
    else:
        raise ValueError(f"unknown record kind {kind!r}")


def replay(records: Iterable[Mapping[str, Any]], state: ClusterState | None = None, *, until: float | None = None) -> ClusterState:
    """Replays records in order with a manual clock set to each record's time.

    Returns the state (a new one with a ``ManualClock`` unless one is given); ``until`` stops at
    that time and leaves the clock there, which is how snapshot tests freeze "now".
    """
    if state is None:
        state = ClusterState(clock=ManualClock())
    clock = state.clock
    for rec in records:
        t = float(rec.get("t", 0.0))
        if until is not None and t > until:
            break
        if isinstance(clock, ManualClock):
            clock.now = max(clock.now, t)
        apply_record(state, rec)
    if until is not None and isinstance(clock, ManualClock):
        clock.now = max(clock.now, until)
    return state


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Reads a recording (JSON lines; blank lines and ``#`` comments skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(json.loads(line))
    return out
