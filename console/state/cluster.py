"""``ClusterState``: the single in-memory picture of the cluster that every screen renders.

Collectors call the ``apply_*`` / ``put_*`` methods (discovery records, load metrics, KV events,
router and planner decisions, frontend scrapes, connection changes); screens only read. It does no
I/O and owns no tasks, so it is tested by feeding it recorded streams with a manual clock.

It is a façade (dolphie's managers): each job lives in a small class it owns, and the views and
collectors keep talking to ``ClusterState`` alone:

- ``EventLog`` (``event_log.py``): the operator-facing events, action results, decode errors;
- ``LoadTally`` (``load.py``): per-worker load, KV and latency figures, and KV transfer rates
  (``KvTransferTracker``, ``transfers.py``);
- ``Topology`` (``topology.py``): instances, workers and model cards from discovery;
- ``FrontendScrapes`` (``frontends.py``) and ``ModelCatalog`` (``models.py``): frontend figures and
  the served models;
- ``ConnectionTracker`` (``connections.py``), ``ImbalanceWatch`` (``imbalance.py``),
  ``DecisionLog`` (``decisions.py``) and the per-pool summary (``pools.py``);
- ``ScalingBoard`` (``scaling.py``): planner decisions, status and operator overrides, joined per
  pool with the workers that run and the latencies the frontends measure;
- ``FailedWorkers`` (``failed.py``): workers ``dynamod up`` gave up on after a crash loop;
- ``RequestBoard`` (``traces.py``): the frontends' slowest recent requests (Requests view).

What is left here is the wiring between them: a router decision is logged and counted against its
worker, a frontend scrape feeds both the model figures and the workers' latencies, and the
once-a-second ``tick`` samples, prunes and checks balance in that order.

Change tracking is by version counters per area (``versions.py``): a screen redraws only what
changed since it last looked.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dynamod.console.state.connections import ConnectionTracker
from dynamod.console.state.decisions import DecisionLog, HeardDecision
from dynamod.console.state.event_log import EventListener, EventLog
from dynamod.console.state.failed import FailedEntry, FailedWorkers
from dynamod.console.state.frontends import FrontendScrapes
from dynamod.console.state.imbalance import ImbalanceWatch
from dynamod.console.state.load import LoadTally
from dynamod.console.state.models import ModelCatalog
from dynamod.console.state.pools import PoolSummary, summarize_pools
from dynamod.console.state.prom import FrontendScrape, parse_frontend_metrics
from dynamod.console.state.records import (
    EV_KV,
    ClusterEvent,
    ConnectionStatus,
    EndpointInstance,
    Imbalance,
    ModelInfo,
    ModelStats,
    Worker,
    WorkerStats,
    fmt_id,
)
from dynamod.console.state.scaling import GlobalRouterPools, PlannerRecord, PoolScaling, ScalingBoard
from dynamod.console.state.tiers import KvTierTracker
from dynamod.console.state.topology import CardEntry, Topology
from dynamod.console.state.traces import RequestBoard
from dynamod.console.state.transfers import KvTransferTracker
from dynamod.console.state.versions import Versions
from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.keys import PLANNER_ROOT
from dynamod.shared.protocol.kv_events import RouterEvent
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.model_card import ModelCard
from dynamod.shared.protocol.planner import PlannerDecision
from dynamod.shared.protocol.supervisor import SUPERVISOR_ROOT, FailedWorker

HISTORY_STEP_S = 1.0
MAX_DECISIONS = 500


class ClusterState:
    """The console's model of the cluster. Not thread-safe: feed it from one event loop."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.versions = Versions()
        self.event_log = EventLog(clock, self.versions)
        self.load = LoadTally(self.versions)
        self.topology = Topology(clock, self.versions, self.event_log, self.load)
        self.frontends = FrontendScrapes(self.versions)
        self.model_catalog = ModelCatalog(self.versions, self.topology, self.frontends, self.load)
        self.connection_tracker = ConnectionTracker(clock, self.versions, self.event_log)
        self.imbalance_watch = ImbalanceWatch(self.event_log)
        self.decision_log = DecisionLog(MAX_DECISIONS)
        self.scaling = ScalingBoard(self.versions, self.event_log, self.topology, self.model_catalog)
        self.failed_workers = FailedWorkers(self.versions, self.event_log)
        self.requests = RequestBoard(self.versions, clock)  # polled only while the Requests view is shown
        self._last_history_at = 0.0
        self._pools_cache: tuple[tuple[int, int], dict[str, PoolSummary]] | None = None

    # -- what the views read ----------------------------------------------------------------------

    @property
    def instances(self) -> dict[str, EndpointInstance]:
        return self.topology.instances

    @property
    def workers(self) -> dict[tuple[str, str, int], Worker]:
        return self.topology.workers

    @property
    def cards(self) -> dict[str, CardEntry]:
        return self.topology.cards

    @property
    def stats(self) -> dict[int, WorkerStats]:
        return self.load.stats

    @property
    def transfers(self) -> KvTransferTracker:
        return self.load.transfers

    @property
    def tiers(self) -> KvTierTracker:
        """Per-worker host/disk KV tier figures (console/state/tiers.py)."""
        return self.load.tiers

    @property
    def events(self) -> deque[ClusterEvent]:
        return self.event_log.events

    @property
    def connections(self) -> dict[str, ConnectionStatus]:
        return self.connection_tracker.connections

    @property
    def imbalances(self) -> list[Imbalance]:
        return self.imbalance_watch.current

    @property
    def decisions(self) -> deque[HeardDecision]:
        """The latest routing decisions, newest last."""
        return self.decision_log.decisions

    @property
    def counters(self) -> dict[str, int]:
        """Inputs taken since start (a fresh dict: read it, do not write to it)."""
        return {
            "load_updates": self.load.load_updates,
            "kv_events": self.load.kv_events,
            "decode_errors": self.event_log.decode_errors,
        }

    @property
    def metric_sources(self) -> list[str]:
        return self.frontends.sources

    # -- events -----------------------------------------------------------------------------------

    def add_event_listener(self, listener: EventListener) -> None:
        self.event_log.add_listener(listener)

    def add_event(self, kind: str, message: str, **where: Any) -> ClusterEvent:
        """``EventLog.add``: ``namespace``, ``component``, ``instance_id`` and ``severity`` by keyword."""
        return self.event_log.add(kind, message, **where)

    def recent_events(self, needle: str = "", kinds: Iterable[str] | None = None, limit: int | None = None) -> list[ClusterEvent]:
        """Newest first, optionally filtered by a text needle and a set of kinds."""
        return self.event_log.recent(needle, kinds, limit)

    def note_decode_error(self, source: str, detail: str) -> None:
        """A message that could not be read. Counted always, shown once per source per minute."""
        self.event_log.note_decode_error(source, detail)

    def record_action(self, action: str, target: str, ok: bool, message: str) -> ClusterEvent:
        return self.event_log.record_action(action, target, ok, message)

    # -- discovery --------------------------------------------------------------------------------

    def apply_discovery(self, key: str, value: Instance | ModelCard | PlannerRecord | FailedWorker | None) -> None:
        """One discovery watch event: a put (decoded record) or a delete (None)."""
        if key.startswith(SUPERVISOR_ROOT):
            if value is None:
                self.failed_workers.delete(key)
            elif isinstance(value, FailedWorker):
                self.failed_workers.put(key, value)
        elif key.startswith(PLANNER_ROOT):
            if value is None or isinstance(value, PlannerRecord):
                self.scaling.apply_record(key, value)
        elif not isinstance(value, PlannerRecord | FailedWorker):
            self.topology.apply_discovery(key, value)

    def put_instance(self, key: str, inst: Instance) -> None:
        self.topology.put_instance(key, inst)

    def delete_instance(self, key: str) -> None:
        self.topology.delete_instance(key)

    def reconcile_instances(self, live: Mapping[str, Instance]) -> None:
        """Makes the picture match a fresh listing (after a reconnect): puts every live record and
        marks every known key absent from it as gone."""
        self.topology.reconcile_instances(live)

    def reconcile_planner(self, live: Mapping[str, PlannerRecord]) -> None:
        """Like ``reconcile_instances`` for the ``v1/planner/`` records (status, overrides...)."""
        self.scaling.reconcile(live)

    def reconcile_failed(self, live: Mapping[str, FailedWorker]) -> None:
        """Like ``reconcile_instances`` for the supervisors' failed-worker records."""
        self.failed_workers.reconcile(live)

    def failed(self, namespace: str | None = None) -> list[FailedEntry]:
        """Workers ``dynamod up`` gave up on (no process, so no instance record), by name."""
        return self.failed_workers.listed(namespace)

    def put_card(self, key: str, card: ModelCard) -> None:
        self.topology.put_card(key, card)

    def delete_card(self, key: str) -> None:
        self.topology.delete_card(key)

    def reconcile_cards(self, live: Mapping[str, ModelCard]) -> None:
        """Like ``reconcile_instances`` for model cards."""
        self.topology.reconcile_cards(live)

    # -- event plane ------------------------------------------------------------------------------

    def apply_load(self, m: LoadMetrics) -> None:
        """A ``kv_metrics`` message. Hot path: 256 workers x 10/s."""
        self.load.apply_load(m, self.clock())

    def apply_kv_event(self, ev: RouterEvent) -> None:
        cleared = self.load.apply_kv_event(ev)
        if cleared is not None:
            worker = self.topology.first_worker(ev.worker_id)
            self.event_log.add(
                EV_KV,
                f"KV cache cleared on {fmt_id(ev.worker_id)} ({cleared} blocks)",
                namespace=worker.namespace if worker else "",
                component=worker.component if worker else "",
                instance_id=ev.worker_id,
            )

    def apply_kv_seed(self, worker_id: int, blocks: int, event_id: int) -> None:
        """A worker's cached blocks read from its ``kv_dump`` (``collectors/kv_seed.py``)."""
        self.load.apply_kv_seed(worker_id, blocks, event_id)

    def apply_router_decision(self, namespace: str, decision: HeardDecision) -> HeardDecision:
        """A ``router_decisions`` message heard in ``namespace`` (``decode_router_decision``). A
        decision without a publish time is stamped with the console's clock."""
        decision.namespace = namespace
        if not decision.ts > 0:
            decision.ts = self.clock()
        self.decision_log.add(decision)
        self.load.note_routed(decision.worker_id)
        self.versions.decisions += 1
        return decision

    def apply_planner_decision(self, namespace: str, decision: PlannerDecision) -> None:
        """A ``planner_decisions`` message (decoded with ``decision_decoder``). The decision names
        its own namespace; ``namespace`` is where it was heard, kept only for a decision without one."""
        if not decision.namespace and namespace:
            decision.namespace = namespace
        self.scaling.apply_decision(decision)

    # -- frontends --------------------------------------------------------------------------------

    def apply_metrics_text(self, source: str, text: str) -> None:
        """One scrape of a frontend's ``/metrics`` (kept as text so recordings replay it exactly)."""
        try:
            scrape = parse_frontend_metrics(text)
        except ValueError as exc:
            self.event_log.note_decode_error(f"metrics {source}", str(exc))
            return
        self.apply_scrape(source, scrape)

    def apply_scrape(self, source: str, scrape: FrontendScrape) -> None:
        """A scrape feeds the model figures and, with its per-worker gauges, the workers' latencies."""
        self.frontends.add(source, scrape, self.clock())
        self.load.apply_latencies(scrape.worker_ttft, scrape.worker_itl, scrape.worker_ttft_by, scrape.worker_itl_by,
                                  self.clock())

    def forget_source(self, source: str) -> None:
        self.frontends.forget(source)

    def scrape_failed(self, source: str, reason: str) -> None:
        """A frontend's ``/metrics`` gave nothing (a 401 without a key, no answer, bad TLS)."""
        self.frontends.failed(source, reason)
        self.versions.load += 1  # the Workers view shows it where TTFT/ITL would be

    def metric_problems(self) -> list[str]:
        """Why some frontend gives no figures, one reason per source (empty when all answer)."""
        return [self.frontends.problems[s] for s in sorted(self.frontends.problems)]

    def model_stats(self) -> dict[str, ModelStats]:
        """Per model over the recent window, summed across frontends."""
        return self.frontends.model_stats()

    def models(self) -> dict[str, ModelInfo]:
        """Served models (base and LoRA) from the cards, with their workers and frontend figures."""
        return self.model_catalog.models()

    # -- connections ------------------------------------------------------------------------------

    def set_connection(self, name: str, state: str, target: str = "", detail: str = "") -> None:
        """``state`` is connecting | ok | lost. Transitions become events; repeats are silent."""
        self.connection_tracker.set(name, state, target, detail)

    # -- time-driven upkeep -----------------------------------------------------------------------

    def tick(self) -> None:
        """Once-a-second upkeep: sparkline samples, pruning of the long gone, imbalance detection.

        Called by the console's refresh timer; it does nothing if called again within a second.
        """
        now = self.clock()
        if now - self._last_history_at < HISTORY_STEP_S:
            return
        self._last_history_at = now
        self.load.sample_history()
        self.topology.prune(now)
        self.load.prune(now, self.topology.live_ids())
        self.imbalance_watch.update(self.topology.workers.values(), now)
        self.versions.load += 1

    # -- queries ----------------------------------------------------------------------------------

    def worker_list(self, *, workers_only: bool = True, include_gone: bool = True) -> list[Worker]:
        return self.topology.worker_list(workers_only=workers_only, include_gone=include_gone)

    def find_worker(self, instance_id: int) -> Worker | None:
        return self.topology.find_worker(instance_id)

    def pools(self) -> dict[str, PoolSummary]:
        """Per-pool load and KV transfer figures (agg, prefill, decode), recomputed on change."""
        version = (self.versions.topology, self.versions.load)
        if self._pools_cache is None or self._pools_cache[0] != version:
            self._pools_cache = (version, summarize_pools(self.topology.workers.values(), self.load.transfers))
        return self._pools_cache[1]

    def namespaces(self) -> list[str]:
        return self.topology.namespaces()

    def scaling_pools(self) -> list[PoolScaling]:
        """Per pool: running vs desired replicas, override, planner prediction and SLA vs measured."""
        return self.scaling.pools()

    def global_routers(self) -> list[GlobalRouterPools]:
        return self.scaling.global_routers()
