"""Frontend metrics with Dynamo's names, so its Grafana dashboards work unchanged.

Label children are resolved once per model (``ModelMetrics``), and the request counter's once per
label set, and kept, because ``labels()`` takes a lock and builds a tuple: the per-token path only
calls ``observe``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynamod.daemon.router.core.prefill_stage import DisaggMetrics
from dynamod.shared.observability.metrics import ITL_BUCKETS_S, LATENCY_BUCKETS, TOKEN_BUCKETS
from dynamod.shared.protocol.llm import PRIORITY_CLASSES, priority_class
from dynamod.shared.protocol.routing import DISAGG_REMOTE, DisaggInfo
from dynamod.shared.protocol.worker_id import worker_id_hex

PREFILL_LOCAL = "local"
PREFILL_REMOTE = "remote"


def prefill_label(disagg: DisaggInfo | None) -> str:
    """The ``prefill`` label of a request's per-worker latency: where its prompt was prefilled."""
    return PREFILL_REMOTE if disagg is not None and disagg.mode == DISAGG_REMOTE else PREFILL_LOCAL


ENDPOINT_CHAT = "chat_completions"
ENDPOINT_COMPLETIONS = "completions"
STATUS_SUCCESS = "success"
STATUS_ERROR = "error"
STATUS_CANCELLED = "cancelled"
MIGRATION_ONGOING = "ongoing_request"
MIGRATION_NEW = "new_request"


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "dynamo_frontend_requests",
            "HTTP requests by model, endpoint, request type (stream/unary) and status",
            ("model", "endpoint", "request_type", "status"),
            registry=registry,
        )
        self.inflight = Gauge(
            "dynamo_frontend_inflight_requests", "Requests being served now", ("model",), registry=registry
        )
        self.ttft = Histogram(
            "dynamo_frontend_time_to_first_token_seconds",
            "Time from request received to first token sent",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # Beside the per-model TTFT (Dynamo's dashboards read that one unchanged): the same by
        # priority class (high, normal, low: a bounded label), so an overloaded cluster shows it
        # serves nvext.agent_hints.priority > 0 first.
        self.ttft_by_priority = Histogram(
            "dynamo_frontend_time_to_first_token_by_priority_seconds",
            "Time from request received to first token sent, by priority class (nvext.agent_hints.priority "
            "> 0: high, 0 or unset: normal, < 0: low)",
            ("model", "priority_class"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "dynamo_frontend_inter_token_latency_seconds",
            "Time between consecutive tokens sent to the client",
            ("model",),
            buckets=ITL_BUCKETS_S,
            registry=registry,
        )
        self.isl = Histogram(
            "dynamo_frontend_input_sequence_tokens",
            "Prompt length in tokens",
            ("model",),
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.osl = Histogram(
            "dynamo_frontend_output_sequence_tokens",
            "Generated tokens per request",
            ("model",),
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "dynamo_frontend_request_duration_seconds",
            "Time from request received to response end",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.migrations = Counter(
            "dynamo_frontend_model_migration",
            "Requests re-sent to another worker after their stream broke or found no worker",
            ("model", "migration_type"),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "dynamo_frontend_prompt_tokens", "Prompt tokens of finished requests", ("model",), registry=registry
        )
        self.cached_tokens = Counter(
            "dynamo_frontend_cached_tokens",
            "Prompt tokens of finished requests that the worker found in its KV cache",
            ("model",),
            registry=registry,
        )
        self.prefix_pins = Counter(
            "dynamo_frontend_prefix_pins",
            "Requests with cache_control by what the worker did with the pin: created (new blocks pinned), "
            "refreshed (all already pinned or cached) or refused (its pinned share of the KV cache was full, "
            "or its engine cannot pin)",
            ("model", "outcome"),
            registry=registry,
        )
        self.kv_hit_rate = Gauge(
            "dynamo_frontend_kv_hit_rate",
            "Cached prompt tokens / prompt tokens since start",
            ("model",),
            registry=registry,
        )
        self.disconnects = Counter(
            "dynamo_frontend_client_disconnects",
            "Requests whose client went away before the response ended (engine request aborted)",
            ("model",),
            registry=registry,
        )
        # Per-worker latency of the last finished request: the console names a slow worker with it.
        # ``prefill`` keeps two populations apart: ``local`` (the worker prefilled the prompt itself:
        # aggregated, or a decode worker's conditional or fallback prefill) and ``remote`` (the
        # prefill pool did): a local prefill's TTFT beside a remote one is no sign of a slow worker.
        self.worker_ttft = Gauge(
            "dynamo_frontend_worker_last_time_to_first_token_seconds",
            "TTFT of the last request a worker finished, by where its prompt was prefilled",
            ("worker_id", "prefill"),
            registry=registry,
        )
        self.worker_itl = Gauge(
            "dynamo_frontend_worker_last_inter_token_latency_seconds",
            "Mean inter-token latency of the last request a worker finished, by where its prompt was prefilled",
            ("worker_id", "prefill"),
            registry=registry,
        )
        # Disaggregated serving: dynamo_frontend_disagg_decisions_total{model,mode,reason},
        # dynamo_frontend_prefill_duration_seconds{model}, dynamo_frontend_prefill_failures_total{model,reason}.
        self.disagg = DisaggMetrics(registry, "dynamo_frontend")
        self._models: dict[str, ModelMetrics] = {}
        self._workers: dict[tuple[int, str], tuple[Gauge, Gauge]] = {}
        self._request_counters: dict[tuple[str, str, bool, str], Counter] = {}

    def for_model(self, model: str) -> ModelMetrics:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(self, model)
        return m

    def worker_latency(
        self, worker_id: int, ttft_s: float, decode_s: float, completion_tokens: int, disagg: DisaggInfo | None = None
    ) -> None:
        """``disagg``: the request's prefill decision (None: aggregated, prefilled locally)."""
        prefill = prefill_label(disagg)
        gauges = self._workers.get((worker_id, prefill))
        if gauges is None:
            if len(self._workers) > 4096:  # a backstop: forget_worker normally keeps the label set small
                self._workers.clear()
                self.worker_ttft.clear()
                self.worker_itl.clear()
            label = worker_id_hex(worker_id)
            gauges = self._workers[(worker_id, prefill)] = (
                self.worker_ttft.labels(label, prefill), self.worker_itl.labels(label, prefill))
        gauges[0].set(ttft_s)
        if completion_tokens > 1:
            gauges[1].set(decode_s / (completion_tokens - 1))

    def forget_worker(self, worker_id: int) -> None:
        """Drops a departed worker's series: without this every worker that ever answered stays
        exported, and the series grow with churn (scale-ups, restarts under new ids)."""
        label = worker_id_hex(worker_id)
        for prefill in (PREFILL_LOCAL, PREFILL_REMOTE):
            if self._workers.pop((worker_id, prefill), None) is None:
                continue
            for gauge in (self.worker_ttft, self.worker_itl):
                try:
                    gauge.remove(label, prefill)
                except KeyError:
                    pass

    def count_request(self, model: str, endpoint: str, stream: bool, status: str) -> None:
        key = (model, endpoint, stream, status)
        child = self._request_counters.get(key)
        if child is None:
            if len(self._request_counters) > 4096:  # model names come and go; keep the cache bounded
                self._request_counters.clear()
            child = self._request_counters[key] = self.requests.labels(
                model, endpoint, "stream" if stream else "unary", status
            )
        child.inc()


class ModelMetrics:
    """The label children of one model, resolved once."""

    __slots__ = (
        "_parent",
        "model",
        "inflight",
        "ttft",
        "_ttft_by_class",
        "itl",
        "isl",
        "osl",
        "duration",
        "migrate_ongoing",
        "migrate_new",
        "prompt_tokens",
        "cached_tokens",
        "kv_hit_rate",
        "disconnects",
        "_prompt_total",
        "_cached_total",
    )

    def __init__(self, parent: FrontendMetrics, model: str) -> None:
        self._parent = parent
        self.model = model
        self.inflight = parent.inflight.labels(model)
        self.ttft = parent.ttft.labels(model)
        self._ttft_by_class = {c: parent.ttft_by_priority.labels(model, c) for c in PRIORITY_CLASSES}
        self.itl = parent.itl.labels(model)
        self.isl = parent.isl.labels(model)
        self.osl = parent.osl.labels(model)
        self.duration = parent.duration.labels(model)
        self.migrate_ongoing = parent.migrations.labels(model, MIGRATION_ONGOING)
        self.migrate_new = parent.migrations.labels(model, MIGRATION_NEW)
        self.prompt_tokens = parent.prompt_tokens.labels(model)
        self.cached_tokens = parent.cached_tokens.labels(model)
        self.kv_hit_rate = parent.kv_hit_rate.labels(model)
        self.disconnects = parent.disconnects.labels(model)
        self._prompt_total = 0
        self._cached_total = 0

    def observe_ttft(self, seconds: float, priority: int | None) -> None:
        """A request's time to first token, overall and in its priority class."""
        self.ttft.observe(seconds)
        self._ttft_by_class[priority_class(priority)].observe(seconds)

    def pin_outcome(self, pinned_tokens: int, refused: bool) -> None:
        """What the worker did with a request's ``cache_control`` pin."""
        outcome = "refused" if refused else "created" if pinned_tokens else "refreshed"
        self._parent.prefix_pins.labels(self.model, outcome).inc()

    def usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        if self._prompt_total:
            self.kv_hit_rate.set(self._cached_total / self._prompt_total)
