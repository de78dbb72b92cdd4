"""Router metrics with Dynamo's names: per-stage overhead histograms, KV events applied, hit rate.

The stage histograms (``dynamo_router_overhead_{hashing,find_matches,scheduling}_seconds``) answer
"is the router the slow part?" without a profiler; the event counter's ``outcome`` label shows a
worker whose stream has gaps or orphaned stores; the hit-rate gauge is what the console plots.

Metrics are created once per ``CollectorRegistry`` (default: the process-global one) and shared by
every router in the process, because prometheus-client refuses a second collector with the same
name on one registry (a frontend serving several models holds several routers).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynamod.shared.observability.per_registry import PerRegistry
from dynamod.shared.protocol.llm import PRIORITY_CLASSES, priority_class

# Routing overhead lives in the microsecond-to-millisecond range: finer buckets than request latency.
OVERHEAD_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
)  # fmt: skip
# A queue wait is 0 (no wait) up to the queue timeout (30 s by default).
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    """The router's collectors on one registry. Use ``router_metrics(registry)`` to share them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.hashing_seconds = Histogram(
            "dynamo_router_overhead_hashing_seconds",
            "Time to hash a request's tokens into block hashes",
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.find_matches_seconds = Histogram(
            "dynamo_router_overhead_find_matches_seconds",
            "Time to look a request's blocks up in the KV index",
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.scheduling_seconds = Histogram(
            "dynamo_router_overhead_scheduling_seconds",
            "Time to score candidates and pick a worker",
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.kv_events = Counter(
            "dynamo_router_kv_events",
            "KV events received by the router, by type and outcome",
            ("event_type", "outcome"),
            registry=registry,
        )
        self.decisions = Counter(
            "dynamo_router_decisions",
            "Routing decisions, by why the winner won",
            ("reason",),
            registry=registry,
        )
        self.request_blocks = Counter(
            "dynamo_router_request_blocks", "Full prompt blocks of routed requests", registry=registry
        )
        self.overlap_blocks = Counter(
            "dynamo_router_overlap_blocks",
            "Prompt blocks already cached on the chosen worker when routed",
            registry=registry,
        )
        self.tier_overlap_blocks = Counter(
            "dynamo_router_tier_overlap_blocks",
            "Prompt blocks the chosen worker held when routed, by KV tier (GPU: its device prefix; "
            "CPU, DISK: the continuation in host memory, then on disk)",
            ("medium",),
            registry=registry,
        )
        self._tier_counters = tuple(self.tier_overlap_blocks.labels(m) for m in ("GPU", "CPU", "DISK"))
        self.kv_hit_rate = Gauge(
            "dynamo_router_kv_hit_rate",
            "Cached share of routed prompt blocks since start (overlap blocks / prompt blocks)",
            registry=registry,
        )
        # Time in the router's wait queue (0 for a request that found a free worker at once), by
        # priority class: under overload the high class's quantiles stay low and say so.
        self.queue_wait_seconds = Histogram(
            "dynamo_router_queue_wait_seconds",
            "Time a request waited in the router queue for a worker that is not busy, by priority class",
            ("priority_class",),
            buckets=QUEUE_WAIT_BUCKETS,
            registry=registry,
        )
        self._queue_wait = {c: self.queue_wait_seconds.labels(c) for c in PRIORITY_CLASSES}
        self._hit_lock = threading.Lock()
        self._hit_total = 0
        self._hit_overlap = 0

    def observe_queue_wait(self, priority: int, waited_s: float) -> None:
        """One routed request's time in the wait queue (``WaitQueue.on_wait``)."""
        self._queue_wait[priority_class(priority)].observe(waited_s)

    def observe_hit(self, request_blocks: int, overlap_blocks: int, host_blocks: int = 0, disk_blocks: int = 0) -> None:
        """Counts one routed request's prompt blocks and how many were already cached: on the
        device (``overlap_blocks``, the hit rate's numerator) and below it, per tier."""
        if request_blocks <= 0:
            return
        self.request_blocks.inc(request_blocks)
        self.overlap_blocks.inc(overlap_blocks)
        gpu, cpu, disk = self._tier_counters
        gpu.inc(overlap_blocks)
        if host_blocks:
            cpu.inc(host_blocks)
        if disk_blocks:
            disk.inc(disk_blocks)
        with self._hit_lock:
            self._hit_total += request_blocks
            self._hit_overlap += overlap_blocks
            self.kv_hit_rate.set(self._hit_overlap / self._hit_total)


# The router metrics registered on a registry (the global one by default), created once.
router_metrics = PerRegistry(RouterMetrics)
