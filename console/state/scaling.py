"""Scaling: what the planner of each namespace wants, what the operator forced, and what runs.

Three sources meet here, and none of them alone answers "is this pool the right size?":

- the planner's decisions (event plane, ``PlannerDecision``, one per pool per interval, ``hold``
  included): what it decided and why, with the load it predicted and the SLA it plans for;
- discovery under ``v1/planner/``: the planner's ``PlannerStatus`` (under its lease, so it vanishes
  with the planner), the operator's ``ScaleOverride`` per pool, and the desired/scaled counts a
  connector and an orchestrator exchange;
- the rest of the picture: how many workers of the pool are registered and ready now (topology),
  and the TTFT/ITL the frontends measure for the namespace's models (scrapes), which stand in for
  the planner's own figures (``PlannerStatus.observed``, what the targets are checked against in
  the console and ``dynamoctl`` alike) while it has measured none.

Each status also adds one sample per pool to ``ScalingHistory`` (``scaling_history.py``), which the
Scaling view plots.

``ScalingBoard`` keeps the first two and joins them with the third into one ``PoolScaling`` per
(namespace, pool), rebuilt only when one of its inputs moved. It does no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from dynamod.console.state.event_log import EventLog
from dynamod.console.state.models import ModelCatalog
from dynamod.console.state.records import EV_SCALING, Worker
from dynamod.console.state.scaling_history import ScalingHistory, ScalingSample
from dynamod.console.state.topology import Topology
from dynamod.console.state.versions import Versions
from dynamod.shared.protocol.instance import STATUS_READY
from dynamod.shared.protocol.keys import PLANNER_ROOT
from dynamod.shared.protocol.planner import (
    ACTION_HOLD,
    POOL_AGG,
    POOL_COMPONENT,
    POOL_DECODE,
    POOL_PREFILL,
    POOLS,
    DesiredReplicas,
    PlannerDecision,
    PlannerStatus,
    ScaledReplicas,
    ScaleOverride,
    pool_of_role,
)

RECENT_DECISIONS = 20  # per pool: enough to see a trend, small enough for 80x24
GLOBAL_ROUTER_ROLE = "global-router"
POOLS_LABEL = "pools"  # a global router's label: the namespaces (pools) it routes to, comma-separated

PlannerRecord = PlannerStatus | ScaleOverride | DesiredReplicas | ScaledReplicas

_POOL_ORDER = {p: i for i, p in enumerate((POOL_AGG, POOL_PREFILL, POOL_DECODE))}


@dataclass(frozen=True, slots=True)
class PlannerKey:
    """What a ``v1/planner/...`` key holds: ``kind`` is status | desired | scaled | override."""

    namespace: str
    kind: str
    pool: str = ""


def parse_planner_key(key: str) -> PlannerKey | None:
    """``v1/planner/{ns}/status|desired|scaled`` or ``.../override/{pool}``; None otherwise."""
    if not key.startswith(PLANNER_ROOT):
        return None
    parts = key[len(PLANNER_ROOT) :].split("/")
    if len(parts) == 2 and parts[1] in ("status", "desired", "scaled") and parts[0]:
        return PlannerKey(parts[0], parts[1])
    if len(parts) == 3 and parts[1] == "override" and parts[0] and parts[2]:
        return PlannerKey(parts[0], "override", parts[2])
    return None


_RECORD_TYPES: dict[str, type[PlannerRecord]] = {
    "status": PlannerStatus,
    "desired": DesiredReplicas,
    "scaled": ScaledReplicas,
    "override": ScaleOverride,
}


def planner_record_type(key: str) -> type[PlannerRecord] | None:
    parsed = parse_planner_key(key)
    return _RECORD_TYPES[parsed.kind] if parsed is not None else None


def decode_planner_record(key: str, raw: bytes) -> PlannerRecord | None:
    """The typed record under ``key`` (JSON in discovery). None for keys of another layout;
    raises ``msgspec.DecodeError``/``ValidationError`` for a malformed value."""
    kind = planner_record_type(key)
    return msgspec.json.decode(raw, type=kind) if kind is not None else None


def convert_planner_record(key: str, value: object) -> PlannerRecord | None:
    """Like ``decode_planner_record`` from already-parsed JSON (a recording's line)."""
    kind = planner_record_type(key)
    return msgspec.convert(value, kind) if kind is not None else None


def pool_of(worker: Worker) -> str | None:
    return pool_of_role(worker.role)


def describe_decision(d: PlannerDecision) -> str:
    """One line for the event log and ``dynamoctl planner decisions``."""
    change = f"{d.current} -> {d.desired}" if d.desired != d.current else f"stays {d.current}"
    text = f"planner {d.planner} {d.namespace}/{d.pool}: {d.action.replace('_', ' ')} {change} ({d.reason}"
    text += f": {d.detail})" if d.detail else ")"
    if d.override is not None:
        text += f" [override {d.override}]"
    if d.dry_run:
        text += " [dry run]"
    if d.error:
        text += f" failed: {d.error}"
    return text


@dataclass(slots=True)
class Latency:
    """What the frontends measure for a namespace's models over the recent window (ms)."""

    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None


@dataclass(slots=True)
class PoolScaling:
    """One pool as the Scaling view and ``dynamoctl planner status`` show it."""

    namespace: str
    pool: str
    component: str
    ready: int = 0  # ready workers of the pool in discovery now
    live: int = 0  # registered workers, whatever their status
    planner: str = ""  # "load" | "sla" | "" (no planner status in this namespace)
    connector: str = ""
    dry_run: bool = False
    current: int | None = None  # what the planner counted
    desired: int | None = None  # what it asks for
    min_replicas: int | None = None
    max_replicas: int | None = None
    override: ScaleOverride | None = None
    scaled: int | None = None  # what the orchestrator reports reaching
    predicted: dict[str, float] = field(default_factory=dict)
    targets: dict[str, float] = field(default_factory=dict)
    measured: Latency = field(default_factory=Latency)
    decisions: list[PlannerDecision] = field(default_factory=list)  # newest first
    # The live figures of the planner's status (its last interval): the namespace's traffic
    # (request_rate, isl, osl, ttft_ms, itl_ms) and this pool's load (waiting, running, kv_usage).
    # The console and dynamoctl both read these, so they show the same numbers.
    observed: dict[str, float] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)
    history: list[ScalingSample] = field(default_factory=list)  # oldest first, one per interval
    last_action: str = ""  # the planner's last decision per its status (dynamoctl has no decision stream)
    last_reason: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.pool}"

    @property
    def target(self) -> int | None:
        """The size the pool is headed for: the operator's override wins over the planner."""
        return self.override.replicas if self.override is not None else self.desired

    @property
    def capacity(self) -> int:
        """The size an operator's new count is compared with to tell whether it removes capacity."""
        target = self.target
        return max(self.ready, target if target is not None else 0)

    @property
    def last(self) -> PlannerDecision | None:
        return self.decisions[0] if self.decisions else None

    @property
    def ttft_ms(self) -> float | None:
        """TTFT as the planner measured it over its last interval (the same figure in the console
        and dynamoctl); without one, the console's own scrapes (p50 over the frontends' window),
        else what the planner's last decision recorded."""
        return self._latency("ttft_ms", self.measured.ttft_p50)

    @property
    def itl_ms(self) -> float | None:
        return self._latency("itl_ms", self.measured.itl_p50)

    def _latency(self, key: str, scraped: float | None) -> float | None:
        if key in self.observed:
            return self.observed[key]
        if scraped is not None:
            return scraped
        return self.last.inputs.get(key) if self.last is not None else None


@dataclass(slots=True)
class GlobalRouterPools:
    """A global router and the pools (namespaces) it routes to, each with its ready workers."""

    instance_id: int
    namespace: str
    status: str
    pools: list[str]
    ready: dict[str, int]  # pool namespace -> ready workers there (0: nothing to route to)
    planned: dict[str, bool]  # pool namespace -> a planner sizes it


class ScalingBoard:
    """Planner records and decisions, and the per-pool join the views read (``pools()``)."""

    def __init__(self, versions: Versions, log: EventLog, topology: Topology, models: ModelCatalog) -> None:
        self._versions = versions
        self._log = log
        self._topology = topology
        self._models = models
        self.statuses: dict[str, PlannerStatus] = {}
        self.overrides: dict[tuple[str, str], ScaleOverride] = {}
        self.desired: dict[str, DesiredReplicas] = {}
        self.scaled: dict[str, ScaledReplicas] = {}
        self._decisions: dict[tuple[str, str], deque[PlannerDecision]] = {}
        self.history = ScalingHistory()
        self._cache: tuple[tuple[int, int, int], list[PoolScaling]] | None = None

    # -- inputs -----------------------------------------------------------------------------------

    def apply_decision(self, d: PlannerDecision) -> None:
        ring = self._decisions.get((d.namespace, d.pool))
        if ring is None:
            ring = self._decisions[(d.namespace, d.pool)] = deque(maxlen=RECENT_DECISIONS)
        ring.appendleft(d)
        self._versions.scaling += 1
        # Holds come every interval for every pool: the Scaling view lists them, the event log
        # keeps only what changed something (or failed to).
        if d.action != ACTION_HOLD or d.error:
            self._log.add(EV_SCALING, describe_decision(d), namespace=d.namespace, component=d.component,
                          severity="error" if d.error else "info")

    def apply_record(self, key: str, value: PlannerRecord | None) -> None:
        """A put (typed record) or delete (None) of a ``v1/planner/...`` key."""
        parsed = parse_planner_key(key)
        if parsed is None:
            return
        ns = parsed.namespace
        if parsed.kind == "status":
            had = ns in self.statuses
            if isinstance(value, PlannerStatus):
                self.statuses[ns] = value
                self.history.add_status(value)
                if not had:
                    self._log.add(EV_SCALING, f"planner {value.planner} for {ns} up ({value.connector} connector"
                                  f"{', dry run' if value.dry_run else ''})", namespace=ns, component="planner")
            elif value is None and had:
                del self.statuses[ns]
                self._log.add(EV_SCALING, f"planner for {ns} gone: its pools keep their size", namespace=ns,
                              component="planner", severity="warning")
        elif parsed.kind == "override":
            pool = (ns, parsed.pool)
            old = self.overrides.get(pool)
            if isinstance(value, ScaleOverride):
                self.overrides[pool] = value
                if old is None or old.replicas != value.replicas:
                    by = f" by {value.set_by}" if value.set_by else ""
                    why = f": {value.reason}" if value.reason else ""
                    self._log.add(EV_SCALING, f"override {ns}/{parsed.pool} = {value.replicas}{by}{why}", namespace=ns)
            elif value is None and old is not None:
                del self.overrides[pool]
                self._log.add(EV_SCALING, f"override {ns}/{parsed.pool} cleared: the planner sizes it again", namespace=ns)
        elif parsed.kind == "desired":
            if isinstance(value, DesiredReplicas):
                self.desired[ns] = value
            else:
                self.desired.pop(ns, None)
        elif parsed.kind == "scaled":
            if isinstance(value, ScaledReplicas):
                self.scaled[ns] = value
            else:
                self.scaled.pop(ns, None)
        self._versions.scaling += 1

    def reconcile(self, live: Mapping[str, PlannerRecord]) -> None:
        """Makes the records match a fresh listing: puts every live one, deletes the rest."""
        known = [*(f"{PLANNER_ROOT}{ns}/status" for ns in self.statuses),
                 *(f"{PLANNER_ROOT}{ns}/override/{pool}" for ns, pool in self.overrides),
                 *(f"{PLANNER_ROOT}{ns}/desired" for ns in self.desired),
                 *(f"{PLANNER_ROOT}{ns}/scaled" for ns in self.scaled)]
        for key in known:
            if key not in live:
                self.apply_record(key, None)
        for key, value in live.items():
            self.apply_record(key, value)

    # -- what the views read ----------------------------------------------------------------------

    def decisions(self, namespace: str, pool: str) -> list[PlannerDecision]:
        """Newest first."""
        return list(self._decisions.get((namespace, pool), ()))

    def pools(self) -> list[PoolScaling]:
        """Every pool known from workers, the planner or an override, sorted by namespace then
        agg/prefill/decode."""
        version = (self._versions.scaling, self._versions.topology, self._versions.models)
        if self._cache is not None and self._cache[0] == version:
            return self._cache[1]
        out: dict[tuple[str, str], PoolScaling] = {}

        def entry(ns: str, pool: str) -> PoolScaling:
            p = out.get((ns, pool))
            if p is None:
                p = out[(ns, pool)] = PoolScaling(ns, pool, POOL_COMPONENT.get(pool, pool))
            return p

        for w in self._topology.workers.values():
            pool = pool_of(w)
            if pool is None or w.gone_at is not None:
                continue
            p = entry(w.namespace, pool)
            p.component = w.component
            p.live += 1
            p.ready += w.status == STATUS_READY
        for ns, status in self.statuses.items():
            for pool, ps in status.pools.items():
                p = entry(ns, pool)
                p.current, p.desired = ps.current, ps.desired
                p.min_replicas, p.max_replicas = ps.min_replicas, ps.max_replicas
                p.component = ps.component or p.component
                p.load = dict(ps.load)
                p.last_action, p.last_reason = ps.action, ps.reason
        for (ns, pool), ring in self._decisions.items():
            p = entry(ns, pool)
            p.decisions = list(ring)
        for (ns, pool), override in self.overrides.items():
            entry(ns, pool).override = override
        latency = self._latency_by_namespace()
        for (ns, pool), p in out.items():
            status = self.statuses.get(ns)
            last = p.last
            if status is not None:
                p.planner, p.connector, p.dry_run = status.planner, status.connector, status.dry_run
                p.targets = dict(status.targets)
                p.predicted = dict(status.predicted)
                p.observed = dict(status.observed)
            if last is not None:
                # The newest decision is at least as fresh as the status, and carries the pool's own
                # prediction; a status-less pool (planner gone) still shows what it last said.
                p.planner = p.planner or last.planner
                p.predicted = dict(last.predicted) or p.predicted
                p.targets = dict(last.targets) or p.targets
                if status is None or pool not in status.pools:
                    p.current, p.desired = last.current, last.desired
                    p.min_replicas, p.max_replicas = last.min_replicas or None, last.max_replicas or None
            scaled = self.scaled.get(ns)
            if scaled is not None and pool in scaled.replicas:
                p.scaled = scaled.replicas[pool]
            p.measured = latency.get(ns, Latency())
            p.history = self.history.samples(ns, pool)
        pools = sorted(out.values(), key=lambda p: (p.namespace, _POOL_ORDER.get(p.pool, len(POOLS)), p.pool))
        self._cache = (version, pools)
        return pools

    def global_routers(self) -> list[GlobalRouterPools]:
        """Every live global router with the pools its ``pools`` label names."""
        planned = set(self.statuses)
        ready: dict[str, int] = {}
        for w in self._topology.workers.values():
            if w.is_worker and w.gone_at is None and w.status == STATUS_READY:
                ready[w.namespace] = ready.get(w.namespace, 0) + 1
        out = []
        for w in self._topology.worker_list(workers_only=False, include_gone=False):
            if w.role != GLOBAL_ROUTER_ROLE:
                continue
            rec = w.endpoints.get("generate") or next(iter(w.endpoints.values()), None)
            label = rec.record.labels.get(POOLS_LABEL, "") if rec is not None else ""
            names = [n.strip() for n in label.split(",") if n.strip()]
            out.append(GlobalRouterPools(w.instance_id, w.namespace, w.status, names,
                                         {n: ready.get(n, 0) for n in names}, {n: n in planned for n in names}))
        return out

    def _latency_by_namespace(self) -> dict[str, Latency]:
        """The worst served model's figures per namespace: an SLA holds only if every model meets it."""
        out: dict[str, Latency] = {}
        for info in self._models.models().values():
            namespaces = {w.namespace for iid in info.workers if (w := self._topology.find_worker(iid)) is not None}
            st = info.stats
            for ns in namespaces:
                lat = out.setdefault(ns, Latency())
                lat.ttft_p50 = _worst(lat.ttft_p50, st.ttft_p50)
                lat.ttft_p99 = _worst(lat.ttft_p99, st.ttft_p99)
                lat.itl_p50 = _worst(lat.itl_p50, st.itl_p50)
                lat.itl_p99 = _worst(lat.itl_p99, st.itl_p99)
        return out


def _worst(a: float | None, b: float | None) -> float | None:
    """Model stats are in seconds; the planner's targets in ms: converted here, once."""
    b_ms = b * 1000.0 if b is not None else None
    if a is None:
        return b_ms
    if b_ms is None:
        return a
    return max(a, b_ms)
