"""The entities ClusterState keeps: endpoint instances, workers (one lease id in one component),
their live statistics, models and operator-facing events (router decisions: ``decisions.py``).

Plain dataclasses with slots: the console holds hundreds of workers updated ten times a second, so
these stay small and are updated in place rather than rebuilt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dynamod.shared.protocol.instance import Instance
from dynamod.shared.protocol.load import LoadMetrics
from dynamod.shared.protocol.worker_id import worker_id_or_dash

ROLE_AGG = "agg"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
WORKER_ROLES = frozenset({ROLE_AGG, ROLE_DECODE, ROLE_PREFILL})
POOL_ORDER = (ROLE_AGG, ROLE_PREFILL, ROLE_DECODE)  # the order pools are listed in
ROLE_ENCODE = "encode"  # an encode worker (vision encoder): listed with the workers, no KV, no pool figures
STATUS_GONE = "gone"
UNSEEDED_EVENTS = 4096  # KV events kept per worker while its kv_dump is on its way
HISTORY_LEN = 60  # sparkline samples, one a second: the last minute of load

# Event kinds shown in the Events view and printed by ``dynamoctl watch``.
EV_REGISTERED = "registered"
EV_EXPIRED = "expired"
EV_DRAIN = "drain"
EV_SLEEP = "sleep"
EV_WAKE = "wake"
EV_LORA = "lora"
EV_SCALING = "scaling"
EV_ERROR = "error"
EV_ACTION = "action"
EV_CONNECTION = "connection"
EV_KV = "kv"
EV_IMBALANCE = "imbalance"
EVENT_KINDS = (
    EV_REGISTERED,
    EV_EXPIRED,
    EV_DRAIN,
    EV_SLEEP,
    EV_WAKE,
    EV_LORA,
    EV_SCALING,
    EV_ERROR,
    EV_ACTION,
    EV_CONNECTION,
    EV_KV,
    EV_IMBALANCE,
)


def fmt_id(instance_id: int | None) -> str:
    """Instance ids print as everywhere else (headers, route explain, logs): 16 lowercase hex
    digits (``shared/protocol/worker_id.py``); ``-`` for none."""
    return worker_id_or_dash(instance_id)


@dataclass(slots=True)
class ClusterEvent:
    ts: float
    kind: str
    message: str
    namespace: str = ""
    component: str = ""
    instance_id: int | None = None
    severity: str = "info"  # info | warning | error

    def to_dict(self) -> dict[str, Any]:
        return {
            "ts": self.ts,
            "kind": self.kind,
            "severity": self.severity,
            "namespace": self.namespace,
            "component": self.component,
            "instance_id": fmt_id(self.instance_id) if self.instance_id is not None else None,
            "message": self.message,
        }

    def matches(self, needle: str) -> bool:
        if not needle:
            return True
        hay = f"{self.kind} {self.severity} {self.namespace}/{self.component} {fmt_id(self.instance_id)} {self.message}"
        return needle.lower() in hay.lower()


@dataclass(slots=True)
class EndpointInstance:
    """One ``v1/instances/...`` record: one endpoint served under one instance id."""

    key: str
    record: Instance
    gone_at: float | None = None

    @property
    def status(self) -> str:
        return STATUS_GONE if self.gone_at is not None else self.record.status


@dataclass(slots=True)
class WorkerStats:
    """What the event plane and frontends tell about one instance id (load, KV, latency)."""

    loads: dict[int, LoadMetrics] = field(default_factory=dict)  # dp_rank -> latest
    last_load_at: float = 0.0
    history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))
    samples: int = 0  # history samples ever taken: lets views cache what they drew from history
    ttft_s: float | None = None  # the headline figure (remote-prefill requests when it has any)
    itl_s: float | None = None
    ttft_by: dict[str, float] = field(default_factory=dict)  # by where the prompt was prefilled
    itl_by: dict[str, float] = field(default_factory=dict)
    # When each of those last changed ("ttft:local" -> time): a "last request" gauge that stopped
    # moving describes an old request, not the worker now.
    latency_changed_at: dict[str, float] = field(default_factory=dict)
    cached_blocks: int = 0
    kv_events: int = 0
    kv_gaps: int = 0
    last_event_id: int = -1
    routed: int = 0  # router decisions that chose this worker
    # Seeding from ``kv_dump`` (a console started after traffic, or after a gap in event ids):
    # until it lands, events are also kept as (event_id, block delta | None for a clear) so the
    # ones newer than the dump can be applied on top of it.
    kv_seeded: bool = False
    kv_unseeded: deque[tuple[int, int | None]] = field(default_factory=lambda: deque(maxlen=UNSEEDED_EVENTS))

    @property
    def running(self) -> int:
        return sum(m.num_running for m in self.loads.values())

    @property
    def waiting(self) -> int:
        return sum(m.num_waiting for m in self.loads.values())

    @property
    def kv_usage(self) -> float | None:
        if not self.loads:
            return None
        return sum(m.kv_usage for m in self.loads.values()) / len(self.loads)

    @property
    def hit_rate(self) -> float | None:
        if not self.loads:
            return None
        return sum(m.prefix_hit_rate for m in self.loads.values()) / len(self.loads)

    @property
    def encoder_busy(self) -> float | None:
        """An encode worker's share of time encoding over its last report (``None``: no report)."""
        if not self.loads:
            return None
        return max(m.encoder_busy for m in self.loads.values())

    @property
    def encode_images_per_s(self) -> float | None:
        if not self.loads:
            return None
        return sum(m.encode_images_per_s for m in self.loads.values())

    def _embedding_counts(self) -> tuple[int, int]:
        """(hits, misses) of a VL worker's embedding cache since start. The cache is the worker's,
        not a rank's: every rank's record carries the same counts, so the freshest (largest) wins."""
        best = (0, 0)
        for m in self.loads.values():
            if m.embedding_cache_hits + m.embedding_cache_misses > sum(best):
                best = (m.embedding_cache_hits, m.embedding_cache_misses)
        return best

    @property
    def embedding_lookups(self) -> int:
        """Images a VL worker looked up in its embedding cache since start (0: none, or text-only)."""
        return sum(self._embedding_counts())

    @property
    def embedding_hit_rate(self) -> float | None:
        """Embedding-cache hits / lookups since start; ``None`` before the first image."""
        hits, misses = self._embedding_counts()
        return hits / (hits + misses) if hits + misses else None

    @property
    def load_value(self) -> float:
        """The sparkline's quantity: requests the worker holds (running + waiting)."""
        return float(self.running + self.waiting)


@dataclass(slots=True)
class Worker:
    """Everything registered under one instance id in one component (Dynamo's "instance").

    A worker process registers ``generate`` and its control endpoints under its lease id; the
    console groups them so a status change is one row and one event, not nine.
    """

    namespace: str
    component: str
    instance_id: int
    endpoints: dict[str, EndpointInstance] = field(default_factory=dict)  # endpoint name -> record
    loras: dict[str, str] = field(default_factory=dict)  # adapter name -> base model
    card_model: str = ""
    stats: WorkerStats = field(default_factory=WorkerStats)
    first_seen: float = 0.0
    gone_at: float | None = None
    status: str = "ready"

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.namespace, self.component, self.instance_id)

    @property
    def id_hex(self) -> str:
        return fmt_id(self.instance_id)

    def _primary(self) -> Instance | None:
        ep = self.endpoints.get("generate") or next(iter(self.endpoints.values()), None)
        return ep.record if ep else None

    def derive_status(self) -> str:
        if self.gone_at is not None:
            return STATUS_GONE
        live = [e for e in self.endpoints.values() if e.gone_at is None]
        if not live:
            return STATUS_GONE
        gen = self.endpoints.get("generate")
        if gen is not None and gen.gone_at is None:
            return gen.record.status
        return live[0].record.status

    @property
    def role(self) -> str:
        rec = self._primary()
        return rec.role if rec else ""

    @property
    def model(self) -> str:
        rec = self._primary()
        return (rec.model if rec and rec.model else "") or self.card_model

    @property
    def node(self) -> str:
        rec = self._primary()
        return rec.node if rec else ""

    @property
    def pid(self) -> int:
        rec = self._primary()
        return rec.pid if rec else 0

    @property
    def started_at(self) -> float:
        rec = self._primary()
        return rec.started_at if rec and rec.started_at else self.first_seen

    @property
    def system_url(self) -> str:
        rec = self._primary()
        return rec.system_url if rec else ""

    @property
    def labels(self) -> dict[str, str]:
        rec = self._primary()
        return dict(rec.labels) if rec else {}

    @property
    def pool(self) -> str:
        """The worker pool it belongs to: its role, with an unnamed engine role counted as agg."""
        role = self.role
        return role if role in WORKER_ROLES else ROLE_AGG

    @property
    def is_worker(self) -> bool:
        """Engine workers (agg/decode/prefill) go to the Workers table; frontends and routers do not."""
        return self.role in WORKER_ROLES or "generate" in self.endpoints and self.role == ""

    @property
    def is_encoder(self) -> bool:
        """An encode worker: in the Workers table and as the ``encode`` pool in the topology, but
        not in the KV pools' figures (it holds no KV and reports no load)."""
        return self.role == ROLE_ENCODE

    def label(self) -> str:
        return f"{self.namespace}/{self.component}/{self.id_hex}"


def fmt_num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.2f}"


@dataclass(slots=True)
class ModelStats:
    """Per served model, from the frontends' metrics over the recent window."""

    request_rate: float | None = None
    requests_total: float = 0.0
    errors_total: float = 0.0
    migrations_total: float = 0.0
    inflight: float = 0.0
    hit_rate: float | None = None  # cached prompt tokens / prompt tokens (window, else lifetime)
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None


@dataclass(slots=True)
class ModelInfo:
    name: str
    base_model: str | None = None  # set for LoRA adapters
    model_types: list[str] = field(default_factory=list)
    context_length: int = 0
    kv_block_size: int = 0
    workers: set[int] = field(default_factory=set)
    stats: ModelStats = field(default_factory=ModelStats)

    @property
    def is_lora(self) -> bool:
        return self.base_model is not None


@dataclass(slots=True)
class Imbalance:
    kind: str  # "hot" | "slow"
    instance_id: int
    namespace: str
    component: str
    message: str


@dataclass(slots=True)
class ConnectionStatus:
    name: str  # "discovery" | "events"
    target: str
    state: str = "connecting"  # connecting | ok | lost
    detail: str = ""
    since: float = 0.0
