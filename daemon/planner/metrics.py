"""The planner's own Prometheus series (``dynamo_planner_*``), on the runtime's registry so the
status server's ``/metrics`` serves them beside ``dynamo_component_*``.

Observed and predicted traffic use Dynamo's planner names (``observed_ttft_ms``,
``predicted_requests_per_second``, ...), so its Grafana panels read ours unchanged; replica counts
carry a ``pool`` label because one planner sizes several pools.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynamod.daemon.planner.policy import Observation
from dynamod.shared.protocol.planner import PlannerDecision

PREFIX = "dynamo_planner"

# predicted-dict key -> gauge suffix (Dynamo's names)
_PREDICTED = {
    "request_rate": "predicted_requests_per_second",
    "isl": "predicted_input_sequence_tokens",
    "osl": "predicted_output_sequence_tokens",
}


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.current = Gauge(f"{PREFIX}_current_replicas", "Ready workers per pool when the planner last decided",
                             ("pool",), registry=registry)
        self.desired = Gauge(f"{PREFIX}_desired_replicas", "Workers per pool the planner last asked for (after overrides)",
                             ("pool",), registry=registry)
        self.override = Gauge(f"{PREFIX}_override_replicas", "The operator's manual count per pool (-1: none in force)",
                              ("pool",), registry=registry)
        self.decisions = Counter(f"{PREFIX}_decisions", "Decisions by pool and action (scale_up, scale_down, hold)",
                                 ("pool", "action"), registry=registry)
        self.connector_errors = Counter(f"{PREFIX}_connector_errors", "Connector calls that failed (retried next interval)",
                                        registry=registry)
        self.source_errors = Counter(f"{PREFIX}_source_errors", "Observation sources that failed in an interval",
                                     ("source",), registry=registry)
        self.last_decision_id = Gauge(f"{PREFIX}_last_decision_id", "Id of the last published decision", registry=registry)
        self.interval = Gauge(f"{PREFIX}_adjustment_interval_seconds", "Seconds between decisions", registry=registry)
        self.kv_usage = Gauge(f"{PREFIX}_observed_kv_usage", "Mean KV usage (0..1) of a pool's ready workers",
                              ("pool",), registry=registry)
        self.waiting = Gauge(f"{PREFIX}_observed_waiting_requests", "Queued requests summed over a pool's ready workers",
                             ("pool",), registry=registry)
        self.ttft = Gauge(f"{PREFIX}_observed_ttft_ms", "Observed mean time to first token over the interval (ms)", registry=registry)
        self.itl = Gauge(f"{PREFIX}_observed_itl_ms", "Observed mean inter-token latency over the interval (ms)", registry=registry)
        self.rps = Gauge(f"{PREFIX}_observed_requests_per_second", "Observed request rate over the interval", registry=registry)
        self.isl = Gauge(f"{PREFIX}_observed_input_sequence_tokens", "Observed mean prompt tokens over the interval", registry=registry)
        self.osl = Gauge(f"{PREFIX}_observed_output_sequence_tokens", "Observed mean output tokens over the interval", registry=registry)
        self.predicted = {
            key: Gauge(f"{PREFIX}_{suffix}", f"Predicted {key} for the next interval", registry=registry)
            for key, suffix in _PREDICTED.items()
        }

    def observed(self, obs: Observation) -> None:
        for pool, p in obs.pools.items():
            if p.loads:
                self.kv_usage.labels(pool).set(sum(w.kv_usage for w in p.loads) / len(p.loads))
            self.waiting.labels(pool).set(sum(w.num_waiting for w in p.loads))
        t = obs.traffic
        if t is None:
            return
        if t.duration_s > 0:
            self.rps.set(t.num_requests / t.duration_s)
        for gauge, value in ((self.ttft, t.ttft_ms), (self.itl, t.itl_ms), (self.isl, t.isl), (self.osl, t.osl)):
            if value is not None:
                gauge.set(value)

    def decided(self, decision: PlannerDecision) -> None:
        pool = decision.pool
        self.current.labels(pool).set(decision.current)
        self.desired.labels(pool).set(decision.desired)
        self.override.labels(pool).set(-1 if decision.override is None else decision.override)
        self.decisions.labels(pool, decision.action).inc()
        self.last_decision_id.set(decision.decision_id)
        for key, value in decision.predicted.items():
            gauge = self.predicted.get(key)
            if gauge is not None:
                gauge.set(value)
