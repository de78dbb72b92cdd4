"""Component (request-plane handler) metrics with Dynamo's names.

Every served endpoint gets ``dynamo_component_requests_total``, ``..._request_duration_seconds``,
``..._inflight_requests`` and ``..._errors_total``, labelled by namespace, component and endpoint,
so Dynamo's dashboards work unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LABELS = ("dynamo_namespace", "dynamo_component", "dynamo_endpoint")


class ComponentMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "dynamo_component_requests", "Requests received by a served endpoint", _LABELS, registry=registry
        )
        self.duration = Histogram(
            "dynamo_component_request_duration_seconds",
            "Time from request received to stream end",
            _LABELS,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inflight = Gauge(
            "dynamo_component_inflight_requests", "Requests being served now", _LABELS, registry=registry
        )
        self.errors = Counter(
            "dynamo_component_errors",
            "Requests that ended in an error",
            (*_LABELS, "error_type"),
            registry=registry,
        )
