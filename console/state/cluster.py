"""``ClusterState``: the single in-memory picture of the cluster that every screen renders.

Collectors call the ``apply_*`` / ``put_*`` methods (discovery records, load metrics, KV events,
router and planner decisions, frontend scrapes, connection changes); screens only read. It does no
I/O and owns no tasks, so it is tested by feeding it recorded streams with a manual clock.

It is a façade: jobs with their own state live in small classes it owns and the views reach through
it: ``DecisionLog`` (routing decisions and the remote/local prefill tally, ``decisions.py``),
``KvTransferTracker`` (KV transfer rates per worker, ``transfers.py``) and the per-pool summary
(``pools.py``).

Change tracking is by version counters per area (``versions.topology`` for discovery,
``versions.load`` for metrics, ...): a screen redraws only what changed since it last looked, which
keeps a 256-worker cluster at ten updates a second cheap to show.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamod.console.state import histogram
from dynamod.console.state.decisions import DecisionLog, decode_decision
from dynamod.console.state.pools import PoolSummary, summarize_pools
from dynamod.console.state.prom import FrontendScrape, parse_frontend_metrics
from dynamod.console.state.records import (
    EV_ACTION,
    EV_CONNECTION,
    EV_DRAIN,
    EV_ERROR,
    EV_EXPIRED,
    EV_IMBALANCE,
    EV_KV,
    EV_LORA,
    EV_REGISTERED,
    EV_SCALING,
    EV_SLEEP,
    EV_WAKE,
    STATUS_GONE,
    ClusterEvent,
    ConnectionStatus,
    EndpointInstance,
    Imbalance,
    ModelInfo,
    ModelStats,
    RouterDecision,
    Worker,
    WorkerStats,
    fmt_id,
)
from dynamod.console.state.transfers import KvTransferTracker
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import INSTANCES_ROOT, MDC_ROOT, parse_key
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, RouterEvent
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.model_card import ModelCard

logger = logging.getLogger(__name__)

GONE_RETENTION_S = 60.0  # a vanished worker stays visible as "gone" this long
ORPHAN_STATS_TTL_S = 30.0  # load from an id discovery never showed is dropped after this
HISTORY_STEP_S = 1.0
LATENCY_WINDOW_S = 60.0
MAX_EVENTS = 2000
MAX_DECISIONS = 500
MAX_SCRAPES_PER_SOURCE = 64
IMBALANCE_REPEAT_S = 300.0

EventListener = Callable[[ClusterEvent], None]


@dataclass(slots=True)
class Versions:
    topology: int = 0  # instances, workers, cards
    load: int = 0  # load metrics, KV events, latencies
    events: int = 0
    decisions: int = 0
    models: int = 0  # frontend scrapes
    connection: int = 0

    def total(self) -> int:
        return self.topology + self.load + self.events + self.decisions + self.models + self.connection


def _as_id(value: Any) -> int | None:
    """Ids arrive as ints (msgpack) or hex strings (JSON, labels)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value:
        try:
            return int(value[2:] if value.lower().startswith("0x") else value, 16)
        except ValueError:
            return None
    return None


class ClusterState:
    """The console's model of the cluster. Not thread-safe: feed it from one event loop."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.versions = Versions()
        self.instances: dict[str, EndpointInstance] = {}
        self.workers: dict[tuple[str, str, int], Worker] = {}
        self.cards: dict[str, tuple[str, str, int, ModelCard]] = {}  # key -> (ns, component, iid, card)
        self.stats: dict[int, WorkerStats] = {}
        self.events: deque[ClusterEvent] = deque(maxlen=MAX_EVENTS)
        self.decision_log = DecisionLog(MAX_DECISIONS)
        self.transfers = KvTransferTracker()
        self.connections: dict[str, ConnectionStatus] = {}
        self.imbalances: list[Imbalance] = []
        self.counters: dict[str, int] = {"load_updates": 0, "kv_events": 0, "decode_errors": 0}
        self._scrapes: dict[str, deque[tuple[float, FrontendScrape]]] = {}
        self._listeners: list[EventListener] = []
        self._error_shown_at: dict[str, float] = {}
        self._imbalance_reported: dict[tuple[str, int], float] = {}
        self._last_history_at = 0.0
        self._models_cache: tuple[int, dict[str, ModelInfo]] | None = None
        self._pools_cache: tuple[tuple[int, int], dict[str, PoolSummary]] | None = None

    @property
    def decisions(self) -> deque[RouterDecision]:
        """The latest routing decisions, newest last."""
        return self.decision_log.decisions

    # -- events ---------------------------------------------------------------------------------

    def add_event_listener(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    def add_event(
        self,
        kind: str,
        message: str,
        *,
        namespace: str = "",
        component: str = "",
        instance_id: int | None = None,
        severity: str = "info",
    ) -> ClusterEvent:
        ev = ClusterEvent(self.clock(), kind, message, namespace, component, instance_id, severity)
        self.events.append(ev)
        self.versions.events += 1
        for listener in self._listeners:
            listener(ev)
        return ev

    def recent_events(self, needle: str = "", kinds: Iterable[str] | None = None, limit: int | None = None) -> list[ClusterEvent]:
        """Newest first, optionally filtered by a text needle and a set of kinds."""
        wanted = set(kinds) if kinds else None
        out: list[ClusterEvent] = []
        for ev in reversed(self.events):
            if wanted is not None and ev.kind not in wanted:
                continue
            if ev.matches(needle):
                out.append(ev)
                if limit is not None and len(out) >= limit:
                    break
        return out

    # -- discovery: instances ---------------------------------------------------------------------

    def put_instance(self, key: str, inst: Instance) -> None:
        now = self.clock()
        existing = self.instances.get(key)
        if existing is not None and existing.gone_at is None and existing.record == inst:
            return
        entry = EndpointInstance(key, inst)
        self.instances[key] = entry
        wkey = (inst.namespace, inst.component, inst.instance_id)
        worker = self.workers.get(wkey)
        if worker is None:
            worker = Worker(inst.namespace, inst.component, inst.instance_id, first_seen=now)
            worker.stats = self.stats.setdefault(inst.instance_id, WorkerStats())
            self.workers[wkey] = worker
        was_gone = worker.gone_at is not None or not worker.endpoints
        worker.endpoints[inst.endpoint] = entry
        worker.gone_at = None
        old_status = worker.status
        worker.status = worker.derive_status()
        self.versions.topology += 1
        if was_gone:
            self._emit_registered(worker)
        elif old_status != worker.status:
            self._emit_status_change(worker, old_status)

    def delete_instance(self, key: str) -> None:
        entry = self.instances.get(key)
        if entry is None or entry.gone_at is not None:
            return
        now = self.clock()
        entry.gone_at = now
        rec = entry.record
        worker = self.workers.get((rec.namespace, rec.component, rec.instance_id))
        self.versions.topology += 1
        if worker is None:
            return
        if all(e.gone_at is not None for e in worker.endpoints.values()):
            before = worker.status
            worker.gone_at = now
            worker.status = STATUS_GONE
            worker.stats.loads.clear()  # its last load is no longer true; the history stays
            self.transfers.forget(worker.instance_id)
            what = "worker" if worker.is_worker else worker.component
            reason = "after draining" if before == "draining" else "(deregistered or lease expired)"
            self.add_event(
                EV_EXPIRED,
                f"{what} {worker.id_hex} gone {reason}",
                namespace=worker.namespace,
                component=worker.component,
                instance_id=worker.instance_id,
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

    def reconcile_cards(self, live: Mapping[str, ModelCard]) -> None:
        """Like ``reconcile_instances`` for model cards."""
        for key, card in live.items():
            self.put_card(key, card)
        for key in [k for k in self.cards if k not in live]:
            self.delete_card(key)

    def _emit_registered(self, worker: Worker) -> None:
        what = "worker" if worker.is_worker else worker.component
        model = f" model={worker.model}" if worker.model else ""
        node = f" node={worker.node}" if worker.node else ""
        role = f" role={worker.role}" if worker.role else ""
        self.add_event(
            EV_REGISTERED,
            f"{what} {worker.id_hex} registered{role}{model}{node}",
            namespace=worker.namespace,
            component=worker.component,
            instance_id=worker.instance_id,
        )

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
        self.add_event(
            kind,
            f"worker {worker.id_hex} {msg}",
            namespace=worker.namespace,
            component=worker.component,
            instance_id=worker.instance_id,
            severity=sev,
        )

    # -- discovery: model cards -------------------------------------------------------------------

    def put_card(self, key: str, card: ModelCard) -> None:
        parsed = parse_key(key)
        if parsed is None or not key.startswith(MDC_ROOT):
            return
        old = self.cards.get(key)
        if old is not None and old[3] == card:
            return
        self.cards[key] = (parsed.namespace, parsed.component, parsed.instance_id, card)
        self.versions.topology += 1
        worker = self._worker_for(parsed.namespace, parsed.component, parsed.instance_id)
        if card.lora or parsed.lora:
            name = card.lora or parsed.lora or card.served_model_name
            if worker is not None:
                worker.loras[name] = card.base_model or ""
            if old is None:
                self.add_event(
                    EV_LORA,
                    f"LoRA {name} loaded on {fmt_id(parsed.instance_id)} (base {card.base_model or '?'})",
                    namespace=parsed.namespace,
                    component=parsed.component,
                    instance_id=parsed.instance_id,
                )
        elif worker is not None:
            worker.card_model = card.served_model_name

    def delete_card(self, key: str) -> None:
        old = self.cards.pop(key, None)
        if old is None:
            return
        ns, component, iid, card = old
        self.versions.topology += 1
        name = card.lora
        if name:
            worker = self._worker_for(ns, component, iid)
            if worker is not None:
                worker.loras.pop(name, None)
            if worker is None or worker.gone_at is None:
                self.add_event(
                    EV_LORA,
                    f"LoRA {name} unloaded from {fmt_id(iid)}",
                    namespace=ns,
                    component=component,
                    instance_id=iid,
                )

    def _worker_for(self, namespace: str, component: str, iid: int) -> Worker | None:
        worker = self.workers.get((namespace, component, iid))
        if worker is not None:
            return worker
        # Cards live under the generate endpoint's component, which is the worker's component.
        for w in self.workers.values():
            if w.instance_id == iid and w.namespace == namespace:
                return w
        return None

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

    # -- event plane ------------------------------------------------------------------------------

    def apply_load(self, m: LoadMetrics) -> None:
        """A ``kv_metrics`` message. Hot path: 256 workers x 10/s, so no allocation beyond the dict."""
        st = self.stats.get(m.worker_id)
        if st is None:
            st = self.stats[m.worker_id] = WorkerStats()
        st.loads[m.dp_rank] = m
        st.last_load_at = self.clock()
        self.transfers.observe(m, st.last_load_at)
        self.counters["load_updates"] += 1
        self.versions.load += 1

    def apply_kv_event(self, ev: RouterEvent) -> None:
        st = self.stats.get(ev.worker_id)
        if st is None:
            st = self.stats[ev.worker_id] = WorkerStats()
        if st.last_event_id >= 0 and ev.event_id > st.last_event_id + 1:
            st.kv_gaps += 1
        st.last_event_id = max(st.last_event_id, ev.event_id)
        st.kv_events += 1
        self.counters["kv_events"] += 1
        event = ev.event
        if isinstance(event, KvStored):
            st.cached_blocks += len(event.blocks)
        elif isinstance(event, KvRemoved):
            st.cached_blocks = max(0, st.cached_blocks - len(event.block_hashes))
        elif isinstance(event, KvCleared):
            cleared = st.cached_blocks
            st.cached_blocks = 0
            worker = next((w for w in self.workers.values() if w.instance_id == ev.worker_id), None)
            self.add_event(
                EV_KV,
                f"KV cache cleared on {fmt_id(ev.worker_id)} ({cleared} blocks)",
                namespace=worker.namespace if worker else "",
                component=worker.component if worker else "",
                instance_id=ev.worker_id,
            )
        self.versions.load += 1

    def apply_router_decision(self, namespace: str, data: Mapping[str, Any]) -> RouterDecision | None:
        """A ``router_decisions`` message (``RoutingDecision.to_dict()`` plus ``ts``/``model``)."""
        try:
            decision = decode_decision(namespace, data, self.clock())
        except (msgspec.ValidationError, TypeError) as exc:
            self.note_decode_error("router_decisions", str(exc))
            return None
        self.decision_log.add(decision)
        self.stats.setdefault(decision.worker_id, WorkerStats()).routed += 1
        self.versions.decisions += 1
        return decision

    def apply_planner_decision(self, namespace: str, data: Mapping[str, Any]) -> None:
        """A ``planner_decisions`` message: shown as a scaling event, whatever its exact shape."""
        message = data.get("message") or data.get("reason") or ""
        detail = " ".join(
            f"{k}={v}" for k, v in data.items() if k not in ("message", "reason", "ts") and not isinstance(v, dict | list)
        )
        text = f"planner: {message}" if message else "planner decision"
        if detail:
            text += f" ({detail})"
        self.add_event(EV_SCALING, text, namespace=namespace, component=str(data.get("component", "")))

    def note_decode_error(self, source: str, detail: str) -> None:
        """A message that could not be read. Counted always, shown once per source per minute."""
        self.counters["decode_errors"] += 1
        now = self.clock()
        last = self._error_shown_at.get(source)
        if last is None or now - last >= 60:
            self._error_shown_at[source] = now
            self.add_event(EV_ERROR, f"unreadable {source} message: {detail}", severity="error")

    # -- frontends --------------------------------------------------------------------------------

    def apply_metrics_text(self, source: str, text: str) -> None:
        """One scrape of a frontend's ``/metrics`` (kept as text so recordings replay it exactly)."""
        try:
            scrape = parse_frontend_metrics(text)
        except ValueError as exc:
            self.note_decode_error(f"metrics {source}", str(exc))
            return
        self.apply_scrape(source, scrape)

    def apply_scrape(self, source: str, scrape: FrontendScrape) -> None:
        now = self.clock()
        ring = self._scrapes.setdefault(source, deque(maxlen=MAX_SCRAPES_PER_SOURCE))
        ring.append((now, scrape))
        while len(ring) > 2 and now - ring[1][0] > LATENCY_WINDOW_S:
            ring.popleft()
        for wid, v in scrape.worker_ttft.items():
            self.stats.setdefault(wid, WorkerStats()).ttft_s = v
        for wid, v in scrape.worker_itl.items():
            self.stats.setdefault(wid, WorkerStats()).itl_s = v
        self.versions.models += 1
        if scrape.worker_ttft or scrape.worker_itl:
            self.versions.load += 1

    def forget_source(self, source: str) -> None:
        if self._scrapes.pop(source, None) is not None:
            self.versions.models += 1

    @property
    def metric_sources(self) -> list[str]:
        return sorted(self._scrapes)

    def model_stats(self) -> dict[str, ModelStats]:
        """Per model over the recent window, summed across frontends."""
        out: dict[str, ModelStats] = {}
        ttft: dict[str, dict[float, float]] = {}
        itl: dict[str, dict[float, float]] = {}
        tokens: dict[str, list[float]] = {}  # model -> [cached, prompt] over the window
        for ring in self._scrapes.values():
            t1, newest = ring[-1]
            t0, oldest = ring[0]
            for model in newest.models:
                st = out.setdefault(model, ModelStats())
                total = newest.requests.get(model, 0.0)
                st.requests_total += total
                st.errors_total += newest.errors.get(model, 0.0)
                st.migrations_total += newest.migrations.get(model, 0.0)
                st.inflight += newest.inflight.get(model, 0.0)
                if t1 > t0:
                    before = oldest.requests.get(model, 0.0)
                    delta = total - before if total >= before else total
                    st.request_rate = (st.request_rate or 0.0) + delta / (t1 - t0)
                prompt = newest.prompt_tokens.get(model, 0.0)
                cached = newest.cached_tokens.get(model, 0.0)
                d_prompt = prompt - oldest.prompt_tokens.get(model, 0.0)
                d_cached = cached - oldest.cached_tokens.get(model, 0.0)
                if t1 <= t0 or d_prompt <= 0 or d_cached < 0:
                    d_prompt, d_cached = prompt, cached  # idle window or a restart: lifetime figures
                acc = tokens.setdefault(model, [0.0, 0.0])
                acc[0] += d_cached
                acc[1] += d_prompt
                for src, dst in ((newest.ttft, ttft), (newest.itl, itl)):
                    buckets = src.get(model)
                    if not buckets:
                        continue
                    older = (oldest.ttft if src is newest.ttft else oldest.itl).get(model)
                    recent = histogram.subtract(buckets, older) if older is not None and t1 > t0 else dict(buckets)
                    if not any(recent.values()):
                        recent = dict(buckets)  # idle window: show the lifetime figures instead of nothing
                    histogram.add(dst.setdefault(model, {}), recent)
        for model, st in out.items():
            cached_sum, prompt_sum = tokens.get(model, (0.0, 0.0))
            if prompt_sum > 0:
                st.hit_rate = cached_sum / prompt_sum
            if model in ttft:
                st.ttft_p50, st.ttft_p99 = histogram.percentiles(ttft[model])
            if model in itl:
                st.itl_p50, st.itl_p99 = histogram.percentiles(itl[model])
        return out

    def models(self) -> dict[str, ModelInfo]:
        """Served models (base and LoRA) from the cards, with their workers and frontend figures."""
        version = self.versions.topology * 1_000_003 + self.versions.models
        if self._models_cache is not None and self._models_cache[0] == version:
            return self._models_cache[1]
        out: dict[str, ModelInfo] = {}
        for ns, component, iid, card in self.cards.values():
            worker = self._worker_for(ns, component, iid)
            if worker is not None and worker.gone_at is not None:
                continue
            name = card.lora or card.served_model_name
            info = out.get(name)
            if info is None:
                info = out[name] = ModelInfo(
                    name=name,
                    base_model=card.base_model if card.lora else None,
                    model_types=list(card.model_types),
                    context_length=card.context_length,
                    kv_block_size=card.kv_block_size,
                )
            info.workers.add(iid)
        for name, stats in self.model_stats().items():
            if not name:
                continue
            info = out.get(name) or out.setdefault(name, ModelInfo(name=name))
            info.stats = stats
        for info in out.values():
            if info.stats.hit_rate is None:
                # No frontend figures: the serving workers' own prefix hit rates stand in.
                rates = [st.hit_rate for iid in info.workers if (st := self.stats.get(iid)) and st.hit_rate is not None]
                if rates:
                    info.stats.hit_rate = sum(rates) / len(rates)
        self._models_cache = (version, out)
        return out

    # -- connection and actions -------------------------------------------------------------------

    def set_connection(self, name: str, state: str, target: str = "", detail: str = "") -> None:
        """``state`` is connecting | ok | lost. Transitions become events; repeats are silent."""
        conn = self.connections.get(name)
        if conn is None:
            conn = self.connections[name] = ConnectionStatus(name, target, "connecting", "", self.clock())
        if target:
            conn.target = target
        changed = conn.state != state
        conn.detail = detail
        if changed:
            previous = conn.state
            conn.state = state
            conn.since = self.clock()
            if state == "lost":
                self.add_event(EV_CONNECTION, f"{name} connection lost ({conn.target}): {detail}", severity="error")
            elif state == "ok" and previous == "lost":
                self.add_event(EV_CONNECTION, f"{name} connection recovered ({conn.target})")
            elif state == "ok":
                self.add_event(EV_CONNECTION, f"{name} connected ({conn.target})")
        self.versions.connection += 1

    def record_action(self, action: str, target: str, ok: bool, message: str) -> ClusterEvent:
        iid = _as_id(target.rsplit("/", 1)[-1])
        return self.add_event(
            EV_ACTION,
            f"{action} {target}: {'ok' if ok else 'failed'}: {message}",
            instance_id=iid,
            severity="info" if ok else "error",
        )

    # -- time-driven upkeep -----------------------------------------------------------------------

    def tick(self) -> None:
        """Once-a-second upkeep: sparkline samples, imbalance detection, pruning of the long gone.

        Called by the console's refresh timer; it does nothing if called again within a second.
        """
        now = self.clock()
        if now - self._last_history_at < HISTORY_STEP_S:
            return
        self._last_history_at = now
        for st in self.stats.values():
            st.history.append(st.load_value)
            st.samples += 1
        self._prune(now)
        self._update_imbalances()
        self.versions.load += 1

    def _prune(self, now: float) -> None:
        pruned = False
        for wkey, worker in list(self.workers.items()):
            if worker.gone_at is not None and now - worker.gone_at > GONE_RETENTION_S:
                del self.workers[wkey]
                for entry in worker.endpoints.values():
                    if self.instances.get(entry.key) is entry:
                        del self.instances[entry.key]
                pruned = True
        live_ids = {w.instance_id for w in self.workers.values()}
        for iid, st in list(self.stats.items()):
            if iid not in live_ids and now - st.last_load_at > ORPHAN_STATS_TTL_S:
                del self.stats[iid]
        self.transfers.retain(set(self.stats))
        for key, entry in list(self.instances.items()):
            if entry.gone_at is not None and now - entry.gone_at > GONE_RETENTION_S:
                del self.instances[key]
                pruned = True
        if pruned:
            self.versions.topology += 1

    def _update_imbalances(self) -> None:
        """Keeps ``imbalances`` current; an event is added when a worker turns hot or slow, at most
        once per worker and kind per ``IMBALANCE_REPEAT_S``, so a flapping worker does not flood."""
        found = detect_imbalances(self.workers.values())
        now = self.clock()
        before = {(i.kind, i.instance_id) for i in self.imbalances}
        for imb in found:
            key = (imb.kind, imb.instance_id)
            last = self._imbalance_reported.get(key)
            if key not in before and (last is None or now - last >= IMBALANCE_REPEAT_S):
                self._imbalance_reported[key] = now
                self.add_event(
                    EV_IMBALANCE,
                    imb.message,
                    namespace=imb.namespace,
                    component=imb.component,
                    instance_id=imb.instance_id,
                    severity="warning",
                )
        self.imbalances = found

    # -- queries ----------------------------------------------------------------------------------

    def worker_list(self, *, workers_only: bool = True, include_gone: bool = True) -> list[Worker]:
        out = [
            w
            for w in self.workers.values()
            if (not workers_only or w.is_worker) and (include_gone or w.gone_at is None)
        ]
        out.sort(key=lambda w: (w.namespace, w.component, w.instance_id))
        return out

    def find_worker(self, instance_id: int) -> Worker | None:
        best: Worker | None = None
        for w in self.workers.values():
            if w.instance_id == instance_id and (best is None or (best.gone_at is not None and w.gone_at is None)):
                best = w
        return best

    def pools(self) -> dict[str, PoolSummary]:
        """Per-pool load and KV transfer figures (agg, prefill, decode), recomputed on change."""
        version = (self.versions.topology, self.versions.load)
        if self._pools_cache is None or self._pools_cache[0] != version:
            self._pools_cache = (version, summarize_pools(self.workers.values(), self.transfers))
        return self._pools_cache[1]

    def namespaces(self) -> list[str]:
        return sorted({w.namespace for w in self.workers.values()})


def _peer_median(values: list[float], index: int) -> float:
    """Median of everyone but ``index``: with two or three workers the hot one must not pull the
    yardstick toward itself."""
    return statistics.median(values[:index] + values[index + 1 :])


def detect_imbalances(workers: Iterable[Worker]) -> list[Imbalance]:
    """Names the hot or slow worker among ready peers serving the same model in one component.

    Each worker is compared with the median of its peers (itself excluded). Hot: KV usage at least
    25 points above that median (and above 50%), or a queue at least four deep and three times the
    peers' median. Slow: recent TTFT or ITL at least twice the peers' median and clearly above it in
    absolute terms (50 ms TTFT, 10 ms ITL), so noise on idle workers stays quiet.
    """
    groups: dict[tuple[str, str, str], list[Worker]] = {}
    for w in workers:
        if w.gone_at is None and w.status == "ready" and w.is_worker and w.stats.loads:
            groups.setdefault((w.namespace, w.component, w.model), []).append(w)
    found: list[Imbalance] = []
    for (ns, component, _model), peers in sorted(groups.items()):
        if len(peers) < 2:
            continue
        kv = [w.stats.kv_usage or 0.0 for w in peers]
        waits = [float(w.stats.waiting) for w in peers]
        for i, w in enumerate(peers):
            med_kv = _peer_median(kv, i)
            med_wait = _peer_median(waits, i)
            reasons = []
            if kv[i] >= 0.5 and kv[i] - med_kv >= 0.25:
                reasons.append(f"KV {kv[i] * 100:.0f}% vs peers {med_kv * 100:.0f}%")
            if waits[i] >= 4 and waits[i] >= 3 * max(med_wait, 1.0):
                reasons.append(f"{waits[i]:.0f} waiting vs peers {med_wait:g}")
            if reasons:
                found.append(Imbalance("hot", w.instance_id, ns, component, f"hot worker {w.id_hex}: " + ", ".join(reasons)))
        for attr, label, floor in (("ttft_s", "TTFT", 0.05), ("itl_s", "ITL", 0.01)):
            have = [w for w in peers if getattr(w.stats, attr) is not None]
            if len(have) < 2:
                continue
            vals = [float(getattr(w.stats, attr)) for w in have]
            for i, w in enumerate(have):
                med = _peer_median(vals, i)
                if vals[i] >= 2 * med and vals[i] - med >= floor:
                    found.append(
                        Imbalance(
                            "slow",
                            w.instance_id,
                            ns,
                            component,
                            f"slow worker {w.id_hex}: {label} {vals[i] * 1000:.0f} ms vs peers {med * 1000:.0f} ms",
                        )
                    )
    return found
