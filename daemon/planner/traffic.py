"""Traffic for the SLA planner, read from the frontends' own ``/metrics`` pages.

Each interval every frontend is scraped and its cumulative series (request count; the sums and
counts of the TTFT, ITL, input- and output-length histograms) are differenced against the previous
scrape of the same page, which is what Prometheus' ``increase()`` does, without needing a
Prometheus server. Means are ``sum(delta _sum) / sum(delta _count)`` over all frontends, so a busy
frontend weighs what it served and an idle one nothing (Dynamo aggregates the same way).

Frontends are found in discovery (their ``frontend/http`` records carry a ``metrics_url`` label,
else their status server's ``system_url``) and from ``--metrics-url``. A frontend seen for the
first time, or one whose last scrape failed, only sets a baseline: differencing across a gap would
put two intervals of requests into one. A counter that went down (the frontend restarted) counts
from zero. Each scrape carries the cluster token when the planner has one: a fleet member's status
server refuses ``/metrics`` without it, and a frontend with API keys accepts it in place of a key.

The request count is the *arrivals*: requests that finished plus the growth of the in-flight gauge.
Finished requests alone cannot exceed what the pools serve, so a saturated cluster would look
exactly as busy as its capacity and never grow; the requests piling up in flight are the demand
it does not yet meet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, fields
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dynamod.daemon.planner.policy import TrafficSample
from dynamod.shared.discovery.store import DiscoveryStore
from dynamod.shared.errors import UnavailableError
from dynamod.shared.observability.status_server import metrics_auth_headers
from dynamod.shared.protocol.keys import instances_prefix
from dynamod.shared.runtime.instances import InstanceSet
from dynamod.shared.security.token import ClusterToken

logger = logging.getLogger(__name__)

# The frontend's series (daemon/frontend/pipeline/metrics.py), Dynamo's names.
REQUESTS = "dynamo_frontend_requests_total"
INFLIGHT = "dynamo_frontend_inflight_requests"
TTFT = "dynamo_frontend_time_to_first_token_seconds"
ITL = "dynamo_frontend_inter_token_latency_seconds"
ISL = "dynamo_frontend_input_sequence_tokens"
OSL = "dynamo_frontend_output_sequence_tokens"
PROMPT_TOKENS = "dynamo_frontend_prompt_tokens_total"
CACHED_TOKENS = "dynamo_frontend_cached_tokens_total"

_SERIES = {
    REQUESTS: "requests",
    INFLIGHT: "inflight",
    f"{TTFT}_sum": "ttft_sum", f"{TTFT}_count": "ttft_count",
    f"{ITL}_sum": "itl_sum", f"{ITL}_count": "itl_count",
    f"{ISL}_sum": "isl_sum", f"{ISL}_count": "isl_count",
    f"{OSL}_sum": "osl_sum", f"{OSL}_count": "osl_count",
    PROMPT_TOKENS: "prompt_tokens", CACHED_TOKENS: "cached_tokens",
}
# Histogram buckets kept per upper bound: how many requests (TTFT) and token gaps (ITL) missed
# a target, which the means cannot say.
_BUCKETS = {f"{TTFT}_bucket": "ttft_le", f"{ITL}_bucket": "itl_le", f"{OSL}_bucket": "osl_le"}
_DICTS = ("ttft_le", "itl_le", "osl_le")


class TrafficSource(Protocol):
    """Where the SLA planner's ``TrafficSample`` comes from (frontend scrape or Prometheus)."""

    name: str

    async def start(self) -> None: ...

    async def sample(self) -> TrafficSample | None:
        """What the frontends saw since the previous call; None when nothing could be measured
        (no frontend yet, first call). Raises UnavailableError when every source failed."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class FrontendTotals:
    """Cumulative figures of one ``/metrics`` page (or their difference between two pages), and
    the requests in flight (a level: its difference may be negative)."""

    requests: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    isl_sum: float = 0.0
    isl_count: float = 0.0
    osl_sum: float = 0.0
    osl_count: float = 0.0
    inflight: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    ttft_le: dict[float, float] = field(default_factory=dict)  # upper bound (s) -> cumulative count
    itl_le: dict[float, float] = field(default_factory=dict)
    osl_le: dict[float, float] = field(default_factory=dict)  # upper bound (tokens) -> cumulative count

    def minus(self, earlier: FrontendTotals) -> FrontendTotals:
        """The increase since ``earlier``; from zero when any counter went down (a restart, which
        also started the in-flight count from zero)."""
        names = [f.name for f in fields(self) if f.name not in _DICTS]
        if any(getattr(self, n) < getattr(earlier, n) for n in names if n != "inflight"):
            return FrontendTotals(**{n: getattr(self, n) for n in names},
                                  **{d: dict(getattr(self, d)) for d in _DICTS})
        return FrontendTotals(**{n: getattr(self, n) - getattr(earlier, n) for n in names},
                              **{d: _combine(getattr(self, d), getattr(earlier, d), -1.0) for d in _DICTS})

    @property
    def arrivals(self) -> float:
        """Of a difference: requests that came in (finished, or still in flight on top of before)."""
        return max(0.0, self.requests + self.inflight)

    def plus(self, other: FrontendTotals) -> FrontendTotals:
        return FrontendTotals(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                                 for f in fields(self) if f.name not in _DICTS},
                              **{d: _combine(getattr(self, d), getattr(other, d), 1.0) for d in _DICTS})


def _combine(a: dict[float, float], b: dict[float, float], sign: float) -> dict[float, float]:
    return {k: max(0.0, a.get(k, 0.0) + sign * b.get(k, 0.0)) for k in set(a) | set(b)}


def _buckets_ms(le: dict[float, float], scale: float = 1000.0) -> tuple[tuple[float, float], ...]:
    """``TrafficSample`` histogram pairs (upper bound in ms, or x ``scale``; cumulative count), sorted."""
    return tuple((k * scale, v) for k, v in sorted(le.items())) if le and max(le.values()) > 0 else ()


def parse_totals(text: str, model: str | None = None) -> FrontendTotals:
    """Sums the frontend series of a Prometheus text page over their label sets (only ``model``'s,
    compared case-insensitively, when given)."""
    totals = FrontendTotals()
    wanted = model.lower() if model else None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            attr = _SERIES.get(s.name)
            bucket = _BUCKETS.get(s.name)
            if attr is None and bucket is None:
                continue
            if wanted is not None and s.labels.get("model", "").lower() != wanted:
                continue
            if bucket is not None:
                le = float(s.labels.get("le", "inf"))
                counts = getattr(totals, bucket)
                counts[le] = counts.get(le, 0.0) + s.value
                continue
            assert attr is not None
            setattr(totals, attr, getattr(totals, attr) + s.value)
    return totals


def sample_from(delta: FrontendTotals, duration_s: float) -> TrafficSample:
    def mean(total: float, count: float, scale: float = 1.0) -> float | None:
        return total / count * scale if count > 0 else None

    return TrafficSample(
        duration_s=duration_s,
        num_requests=delta.arrivals,
        isl=mean(delta.isl_sum, delta.isl_count),
        osl=mean(delta.osl_sum, delta.osl_count),
        ttft_ms=mean(delta.ttft_sum, delta.ttft_count, 1000.0),
        itl_ms=mean(delta.itl_sum, delta.itl_count, 1000.0),
        ttft_buckets=_buckets_ms(delta.ttft_le),
        itl_buckets=_buckets_ms(delta.itl_le),
        osl_buckets=_buckets_ms(delta.osl_le, 1.0),
        hit_rate=mean(delta.cached_tokens, delta.prompt_tokens),
    )


class FrontendScrape:
    """``TrafficSource`` over the frontends' ``/metrics`` pages."""

    name = "frontend"

    def __init__(self, store: DiscoveryStore | None, namespace: str, *, urls: list[str] | None = None,
                 frontend_component: str = "frontend", model: str | None = None, timeout_s: float = 5.0,
                 client: httpx.AsyncClient | None = None, token: ClusterToken | None = None) -> None:
        self._static = list(urls or [])
        self._headers = metrics_auth_headers(token)
        self._instances = (
            InstanceSet(store, instances_prefix(namespace, frontend_component)) if store is not None and frontend_component else None
        )
        self._model = model
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._previous: dict[str, FrontendTotals] = {}
        self._last_t: float | None = None

    async def start(self) -> None:
        if self._instances is not None:
            await self._instances.start()
        try:
            await self.sample()  # the baseline
        except UnavailableError as exc:  # frontends may come later; the next interval baselines
            logger.info("frontend metrics not readable yet error=%s", exc)

    async def close(self) -> None:
        if self._instances is not None:
            await self._instances.close()
        await self._client.aclose()

    def urls(self) -> list[str]:
        found = list(self._static)
        if self._instances is not None:
            for inst in sorted(self._instances.instances, key=lambda i: i.instance_id):
                url = inst.labels.get("metrics_url") or (f"{inst.system_url}/metrics" if inst.system_url else "")
                if url:
                    found.append(url)
        return list(dict.fromkeys(found))

    async def _scrape(self, url: str) -> FrontendTotals:
        resp = await self._client.get(url, headers=self._headers)
        resp.raise_for_status()
        return parse_totals(resp.text, self._model)

    async def sample(self) -> TrafficSample | None:
        now = time.monotonic()
        urls = self.urls()
        results = await asyncio.gather(*(self._scrape(u) for u in urls), return_exceptions=True)
        delta: FrontendTotals | None = None
        failures: list[str] = []
        current: dict[str, FrontendTotals] = {}
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                failures.append(f"{url}: {result!r}")
                continue
            current[url] = result
            earlier = self._previous.get(url)
            if earlier is not None:
                step = result.minus(earlier)
                delta = step if delta is None else delta.plus(step)
        # Failed and departed frontends lose their baseline (see the module docstring).
        self._previous = current
        duration = None if self._last_t is None else now - self._last_t
        self._last_t = now
        if failures:
            logger.warning("frontend scrape failed count=%d of=%d errors=%s", len(failures), len(urls), "; ".join(failures))
            if not current:
                raise UnavailableError(f"no frontend /metrics page could be read: {'; '.join(failures)}")
        if delta is None or duration is None or duration <= 0:
            return None
        return sample_from(delta, duration)
