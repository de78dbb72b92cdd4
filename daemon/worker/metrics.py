"""Worker-level Prometheus metrics beside the runtime's ``dynamo_component_*`` ones."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynamod.shared.kv.transfer.base import TransferResult
from dynamod.shared.protocol.instance import STATUSES
from dynamod.shared.protocol.load import KvTierLoad, LoadMetrics
from dynamod.shared.protocol.worker_id import worker_id_hex

# KV reads take from well under a millisecond (a few blocks on loopback) to seconds (a long
# prompt of a large model over a slow link).
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The exposed transfer is a few ms to tens of ms when it overlaps the prefill: finer where it lives.
EXPOSED_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                   0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


class KvTransferMetrics:
    """Disaggregated serving: what a worker pulled (decode) or served (prefill), failures, holds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter(
            "dynamo_component_kv_transfer_bytes", "KV bytes moved between workers",
            ("worker_id", "direction", "backend"), registry=registry,
        )
        self.blocks = Counter(
            "dynamo_component_kv_transfer_blocks", "KV blocks moved between workers",
            ("worker_id", "direction", "backend"), registry=registry,
        )
        self.seconds = Histogram(
            "dynamo_component_kv_transfer_seconds", "Wall time of one KV read (decode side)",
            ("worker_id", "backend"), buckets=TRANSFER_BUCKETS, registry=registry,
        )
        self.failures = Counter(
            "dynamo_component_kv_transfer_failures", "KV reads that failed (the request was prefilled locally)",
            ("worker_id", "reason"), registry=registry,
        )
        self.held_blocks = Gauge(
            "dynamo_component_kv_held_blocks", "KV blocks held for decode workers to read (prefill)",
            ("worker_id",), registry=registry,
        )
        self.hold_expired_total = Counter(
            "dynamo_component_kv_hold_expired", "Holds freed because no decode worker read them in time",
            ("worker_id",), registry=registry,
        )
        self.exposed_seconds = Histogram(
            "dynamo_component_kv_transfer_exposed_seconds",
            "Decode side: the prefill's last KV block computed until the decode worker had every block "
            "(the transfer time the first token waits for); overlap streamed or none",
            ("worker_id", "overlap"), buckets=EXPOSED_BUCKETS, registry=registry,
        )

    def pulled(self, worker_id: str, result: TransferResult) -> None:
        self.bytes.labels(worker_id, "pulled", result.backend).inc(result.num_bytes)
        self.blocks.labels(worker_id, "pulled", result.backend).inc(result.num_blocks)
        self.seconds.labels(worker_id, result.backend).observe(result.seconds)

    def exposed(self, worker_id: str, ms: float, streamed: bool) -> None:
        self.exposed_seconds.labels(worker_id, "streamed" if streamed else "none").observe(ms / 1000.0)

    def served(self, worker_id: str, backend: str, num_blocks: int, num_bytes: int) -> None:
        self.bytes.labels(worker_id, "served", backend).inc(num_bytes)
        self.blocks.labels(worker_id, "served", backend).inc(num_blocks)

    def failed(self, worker_id: str, reason: str) -> None:
        self.failures.labels(worker_id, reason).inc()

    def hold_expired(self, worker_id: str) -> None:
        self.hold_expired_total.labels(worker_id).inc()

    def held(self, worker_id: str, num_blocks: int) -> None:
        self.held_blocks.labels(worker_id).set(num_blocks)


class KvTierMetrics:
    """Lower KV tiers (host memory, disk) per rank: occupancy and traffic, labelled by ``medium``.

    Engines report cumulative counts (``KvTierLoad``); the counters advance by the difference
    since the last report, so a scrape sees ordinary monotonic counters."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("worker_id", "dp_rank", "medium")
        self.usage = Gauge(
            "dynamo_component_kv_tier_usage_percent", "Blocks a lower KV tier holds over its capacity (0-1)",
            labels, registry=registry,
        )
        self.blocks = Gauge("dynamo_component_kv_tier_blocks", "Blocks a lower KV tier holds", labels, registry=registry)
        self.capacity = Gauge(
            "dynamo_component_kv_tier_capacity_blocks", "Capacity of a lower KV tier in blocks", labels, registry=registry
        )
        self.hit_tokens = Counter(
            "dynamo_component_kv_tier_hit_tokens", "Prompt tokens onboarded from a lower KV tier instead of recomputed",
            labels, registry=registry,
        )
        self.onboarded = Counter(
            "dynamo_component_kv_tier_onboarded_blocks", "Blocks copied from a lower KV tier back to the device",
            labels, registry=registry,
        )
        self.offloaded = Counter(
            "dynamo_component_kv_tier_offloaded_blocks", "Blocks moved into a lower KV tier", labels, registry=registry
        )
        self._last: dict[tuple[str, str, str, str], int] = {}

    def load(self, worker_id: str, dp_rank: str, tiers: dict[str, KvTierLoad]) -> None:
        for medium, t in tiers.items():
            labels = (worker_id, dp_rank, medium)
            self.usage.labels(*labels).set(t.usage)
            self.blocks.labels(*labels).set(t.blocks)
            self.capacity.labels(*labels).set(t.total_blocks)
            for name, counter, value in (
                ("hit", self.hit_tokens, t.hit_tokens),
                ("on", self.onboarded, t.onboarded_blocks),
                ("off", self.offloaded, t.offloaded_blocks),
            ):
                key = (*labels, name)
                delta = value - self._last.get(key, 0)
                if delta > 0:
                    counter.labels(*labels).inc(delta)
                self._last[key] = value  # a smaller value: the engine restarted its count


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
        self.kv_transfer = KvTransferMetrics(registry)
        self.kv_tiers = KvTierMetrics(registry)

    def load(self, m: LoadMetrics) -> None:
        labels = (worker_id_hex(m.worker_id), str(m.dp_rank))
        self.kv_usage.labels(*labels).set(m.kv_usage)
        self.running.labels(*labels).set(m.num_running)
        self.waiting.labels(*labels).set(m.num_waiting)
        self.hit_rate.labels(*labels).set(m.prefix_hit_rate)
        self.active_blocks.labels(*labels).set(m.active_decode_blocks)
        if m.kv_tiers:
            self.kv_tiers.load(*labels, m.kv_tiers)

    def kv_event(self, worker_id: int, kind: str) -> None:
        self.kv_events.labels(worker_id_hex(worker_id), kind).inc()

    def status(self, worker_id: int, status: str) -> None:
        for s in STATUSES:
            self.status_gauge.labels(worker_id_hex(worker_id), s).set(1 if s == status else 0)
