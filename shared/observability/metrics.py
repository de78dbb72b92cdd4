"""Component (request-plane handler) metrics with Dynamo's names.

Every served endpoint gets ``dynamo_component_requests_total``, ``..._request_duration_seconds``,
``..._inflight_requests`` and ``..._errors_total``, labelled by namespace, component and endpoint,
so Dynamo's dashboards work unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The frontend's token-count and inter-token-latency histograms' buckets: here, not in the frontend,
# because the planner (and its replay) read those histograms bucket by bucket.
TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ITL_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
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
