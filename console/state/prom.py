"""Reads the numbers the console needs out of a frontend's Prometheus ``/metrics`` text.

Names follow Dynamo's frontend (``dynamo_frontend_*``), so the console works against our frontend
and against Dynamo's. Unknown families are ignored: a scrape never fails because a frontend exports
more than we read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REQUESTS = "dynamo_frontend_requests"
TTFT = "dynamo_frontend_time_to_first_token_seconds"
ITL = "dynamo_frontend_inter_token_latency_seconds"
INFLIGHT = "dynamo_frontend_inflight_requests"
MIGRATIONS = ("dynamo_frontend_model_migration", "dynamo_frontend_migrations")
PROMPT_TOKENS = "dynamo_frontend_prompt_tokens"
CACHED_TOKENS = "dynamo_frontend_cached_tokens"
WORKER_TTFT = "dynamo_frontend_worker_last_time_to_first_token_seconds"
WORKER_ITL = "dynamo_frontend_worker_last_inter_token_latency_seconds"
PREFILL_LOCAL = "local"
PREFILL_REMOTE = "remote"
OK_STATUSES = frozenset({"success", "ok", "200", "cancelled"})  # a client hanging up is not an error


@dataclass(slots=True)
class FrontendScrape:
    """One scrape of one frontend, keyed by served model name (and worker id for per-worker gauges)."""

    requests: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, dict[float, float]] = field(default_factory=dict)
    itl: dict[str, dict[float, float]] = field(default_factory=dict)
    inflight: dict[str, float] = field(default_factory=dict)
    migrations: dict[str, float] = field(default_factory=dict)
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    cached_tokens: dict[str, float] = field(default_factory=dict)
    worker_ttft: dict[int, float] = field(default_factory=dict)  # the headline figure per worker
    worker_itl: dict[int, float] = field(default_factory=dict)
    # By (worker, where the prompt was prefilled: local | remote): two populations the imbalance
    # check must not compare with each other (a frontend without the label gives "local").
    worker_ttft_by: dict[tuple[int, str], float] = field(default_factory=dict)
    worker_itl_by: dict[tuple[int, str], float] = field(default_factory=dict)

    @property
    def models(self) -> set[str]:
        return set(self.requests) | set(self.ttft) | set(self.itl) | set(self.inflight) | set(self.migrations)


def parse_worker_id(text: str) -> int | None:
    """Worker ids are printed in hex across the project (``{id:x}``); ``0x`` is tolerated."""
    try:
        return int(text[2:] if text.lower().startswith("0x") else text, 16)
    except ValueError:
        return None


def _bucket_bound(le: str) -> float:
    return math.inf if le in ("+Inf", "Inf", "inf") else float(le)


def _sum_by_model(target: dict[str, float], samples: Iterable[Sample], *, suffix: str = "_total") -> None:
    """Adds each sample named ``...suffix`` to its model's entry (a counter's ``_total`` by default;
    label sets other than the model, such as a status, are summed)."""
    for s in samples:
        if s.name.endswith(suffix):
            model = s.labels.get("model", "")
            target[model] = target.get(model, 0.0) + s.value


def parse_frontend_metrics(text: str) -> FrontendScrape:
    """Parses Prometheus text exposition; raises ValueError on text that is not exposition format."""
    out = FrontendScrape()
    for family in text_string_to_metric_families(text):
        name = family.name
        if name == REQUESTS:
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                model = s.labels.get("model", "")
                out.requests[model] = out.requests.get(model, 0.0) + s.value
                if s.labels.get("status", "success").lower() not in OK_STATUSES:
                    out.errors[model] = out.errors.get(model, 0.0) + s.value
        elif name in (TTFT, ITL):
            target = out.ttft if name == TTFT else out.itl
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    model = s.labels.get("model", "")
                    bounds = target.setdefault(model, {})
                    le = _bucket_bound(s.labels["le"])
                    bounds[le] = bounds.get(le, 0.0) + s.value
        elif name == INFLIGHT:
            _sum_by_model(out.inflight, family.samples, suffix="")
        elif name in MIGRATIONS:
            _sum_by_model(out.migrations, family.samples)
        elif name in (PROMPT_TOKENS, CACHED_TOKENS):
            _sum_by_model(out.prompt_tokens if name == PROMPT_TOKENS else out.cached_tokens, family.samples)
        elif name in (WORKER_TTFT, WORKER_ITL):
            by = out.worker_ttft_by if name == WORKER_TTFT else out.worker_itl_by
            for s in family.samples:
                wid = parse_worker_id(s.labels.get("worker_id", ""))
                if wid is not None:
                    by[(wid, s.labels.get("prefill") or PREFILL_LOCAL)] = s.value
    for by, headline in ((out.worker_ttft_by, out.worker_ttft), (out.worker_itl_by, out.worker_itl)):
        # A decode worker's usual request is prefilled remotely: that is its headline figure.
        for (wid, _prefill), value in sorted(by.items(), key=lambda kv: kv[0][1] == PREFILL_REMOTE):
            headline[wid] = value
    return out
