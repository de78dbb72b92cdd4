"""The global router's Prometheus metrics (``dynamo_global_router_*``).

They answer the operator's questions about pools: where does the traffic go (``requests`` per
pool, counted on every attempt, so a retried request counts on both pools), why there (``selections``
by reason: the grid or a priority override), how often a pool fails before its first output
(``pool_failures``) and where the retries went (``retries``), and what is in flight now.
``stage`` is ``agg``, ``prefill`` or ``decode``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class GlobalRouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "dynamo_global_router_requests",
            "Requests forwarded to a pool (every attempt), by stage and pool namespace",
            ("stage", "pool"),
            registry=registry,
        )
        self.selections = Counter(
            "dynamo_global_router_selections",
            "Pool selections, by stage, chosen pool and reason (grid or priority_override)",
            ("stage", "pool", "reason"),
            registry=registry,
        )
        self.retries = Counter(
            "dynamo_global_router_retries",
            "Requests retried on a faster pool after a failure before the first output",
            ("stage", "from_pool", "to_pool"),
            registry=registry,
        )
        self.pool_failures = Counter(
            "dynamo_global_router_pool_failures",
            "Attempts that failed before their first output, by stage and pool",
            ("stage", "pool"),
            registry=registry,
        )
        self.inflight = Gauge(
            "dynamo_global_router_inflight_requests",
            "Requests the global router is streaming now, by stage",
            ("stage",),
            registry=registry,
        )
