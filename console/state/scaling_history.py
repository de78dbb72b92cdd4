"""Scaling over time: per pool, one sample per planner interval of what it wanted, what was
ready, the load and the latency it planned against.

The Scaling view's plot answers "did the fleet follow the load, and did it meet the SLA while
doing so?", which no single row can. Every figure comes from the planner's ``PlannerStatus``
(written once per interval): the pool's ready count as the planner counted it, its desired count,
the pool's queued/running requests and KV usage, and the traffic the planner measured (request
rate, TTFT, ITL). Reading them from that one record keeps the plot, the table and
``dynamoctl planner status`` on the same numbers, and a recorded cluster replays the same plot.

A sample is taken when the status names a new decision id (a status rewritten for the same
interval adds nothing); each pool keeps the newest ``HISTORY_SAMPLES``, enough for a 160-column
terminal. No I/O here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dynamod.shared.protocol.planner import PlannerStatus

HISTORY_SAMPLES = 240


@dataclass(frozen=True, slots=True)
class ScalingSample:
    """One pool at one planner interval. ``None``: not measured in that interval."""

    decision_id: int
    ts: float  # unix time of the status
    ready: int  # ready replicas the planner counted
    desired: int  # what it asked for (the operator's override when one is in force)
    request_rate: float | None = None  # arrivals/s over the interval (the namespace's traffic)
    waiting: float | None = None  # requests queued on the pool's workers
    running: float | None = None
    kv_usage: float | None = None  # the fullest worker's KV share, 0..1
    ttft_ms: float | None = None
    itl_ms: float | None = None


class ScalingHistory:
    """(namespace, pool) -> its recent samples, oldest first."""

    def __init__(self, capacity: int = HISTORY_SAMPLES) -> None:
        self._capacity = capacity
        self._rings: dict[tuple[str, str], deque[ScalingSample]] = {}
        self._last_id: dict[str, int] = {}

    def add_status(self, status: PlannerStatus) -> bool:
        """Samples every pool of ``status``; False (nothing added) when its decision id was
        already sampled or it has decided nothing yet."""
        ns = status.namespace
        if status.last_decision_id <= 0 or self._last_id.get(ns) == status.last_decision_id:
            return False
        if status.last_decision_id < self._last_id.get(ns, 0):
            # A new planner started its ids over (no desired/scaled record to continue from):
            # its samples must not be drawn between the old planner's.
            for key in [k for k in self._rings if k[0] == ns]:
                del self._rings[key]
        self._last_id[ns] = status.last_decision_id
        observed = status.observed
        for pool, ps in status.pools.items():
            ring = self._rings.get((ns, pool))
            if ring is None:
                ring = self._rings[(ns, pool)] = deque(maxlen=self._capacity)
            load = ps.load
            ring.append(ScalingSample(
                decision_id=status.last_decision_id, ts=status.ts, ready=ps.current,
                desired=ps.override if ps.override is not None else ps.desired,
                request_rate=observed.get("request_rate"), waiting=load.get("waiting"), running=load.get("running"),
                kv_usage=load.get("kv_usage"), ttft_ms=observed.get("ttft_ms"), itl_ms=observed.get("itl_ms"),
            ))
        return True

    def samples(self, namespace: str, pool: str) -> list[ScalingSample]:
        """Oldest first."""
        return list(self._rings.get((namespace, pool), ()))
