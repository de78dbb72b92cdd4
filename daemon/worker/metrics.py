"""Worker-level Prometheus metrics beside the runtime's ``dynamo_component_*`` ones."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynamod.shared.protocol.instance import STATUSES
from dynamod.shared.protocol.load import LoadMetrics


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("worker_id", "dp_rank")
        self.kv_usage = Gauge("dynamo_component_kv_cache_usage_percent", "KV cache blocks in use (0-1)", labels, registry=registry)
        self.running = Gauge("dynamo_component_running_requests", "Requests running in the engine", labels, registry=registry)
        self.waiting = Gauge("dynamo_component_waiting_requests", "Requests waiting in the engine", labels, registry=registry)
        self.hit_rate = Gauge(
            "dynamo_component_prefix_cache_hit_rate", "Cached prompt tokens over prompt tokens", labels, registry=registry
        )
        self.active_blocks = Gauge(
            "dynamo_component_active_decode_blocks", "KV blocks held by running sequences", labels, registry=registry
        )
        self.kv_events = Counter(
            "dynamo_component_kv_events", "KV cache events published", ("worker_id", "type"), registry=registry
        )
        self.status_gauge = Gauge(
            "dynamo_component_worker_status", "1 for the worker's current status", ("worker_id", "status"), registry=registry
        )

    def load(self, m: LoadMetrics) -> None:
        labels = (f"{m.worker_id:x}", str(m.dp_rank))
        self.kv_usage.labels(*labels).set(m.kv_usage)
        self.running.labels(*labels).set(m.num_running)
        self.waiting.labels(*labels).set(m.num_waiting)
        self.hit_rate.labels(*labels).set(m.prefix_hit_rate)
        self.active_blocks.labels(*labels).set(m.active_decode_blocks)

    def kv_event(self, worker_id: int, kind: str) -> None:
        self.kv_events.labels(f"{worker_id:x}", kind).inc()

    def status(self, worker_id: int, status: str) -> None:
        for s in STATUSES:
            self.status_gauge.labels(f"{worker_id:x}", s).set(1 if s == status else 0)
