"""Traffic for the SLA planner from a Prometheus server (``--prometheus-url``).

Where Prometheus already scrapes every frontend (Kubernetes), asking it is cheaper and sees
frontends the planner cannot reach. The queries are Dynamo's: the request count is
``sum(increase(requests_total[W]))`` and each mean is ``sum(increase(x_sum[W])) /
sum(increase(x_count[W]))`` over the adjustment interval ``W``, through the HTTP API's
``/api/v1/query``. No data (an empty vector, NaN) is "unknown", never zero: a planner that read an
outage as idleness would scale the fleet down under load.
"""

from __future__ import annotations

import asyncio
import logging
import math

import httpx

from dynamod.daemon.planner.policy import TrafficSample
from dynamod.daemon.planner.traffic import INFLIGHT, ISL, ITL, OSL, REQUESTS, TTFT
from dynamod.shared.errors import UnavailableError

logger = logging.getLogger(__name__)


def _selector(model: str | None, extra: str) -> str:
    parts = [f'model="{model}"'] if model else []
    if extra.strip():
        parts.append(extra.strip().strip("{}"))
    return "{" + ",".join(parts) + "}" if parts else ""


def traffic_queries(window_s: float, model: str | None = None, extra_selector: str = "") -> dict[str, str]:
    """PromQL per ``TrafficSample`` field over a window of ``window_s`` seconds."""
    sel = _selector(model, extra_selector)
    w = f"[{max(1, math.ceil(window_s))}s]"

    def mean(metric: str) -> str:
        return f"sum(increase({metric}_sum{sel}{w})) / sum(increase({metric}_count{sel}{w}))"

    return {
        # Arrivals: finished plus the growth of in-flight (traffic.py says why); a fleet without
        # the gauge counts finished requests only.
        "num_requests": f"sum(increase({REQUESTS}{sel}{w})) + (sum(delta({INFLIGHT}{sel}{w})) or vector(0))",
        "ttft_s": mean(TTFT),
        "itl_s": mean(ITL),
        "isl": mean(ISL),
        "osl": mean(OSL),
    }


def scalar_of(body: dict) -> float | None:
    """The value of an instant-vector answer with one sample; None when empty or NaN."""
    if body.get("status") != "success":
        raise UnavailableError(f"prometheus query failed: {body.get('errorType', '')} {body.get('error', '')}".strip())
    result = body.get("data", {}).get("result", [])
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if math.isnan(value) or math.isinf(value) else value


class PrometheusTraffic:
    """``TrafficSource`` over a Prometheus server's HTTP API."""

    name = "prometheus"

    def __init__(self, url: str, window_s: float, *, model: str | None = None, extra_selector: str = "",
                 timeout_s: float = 10.0, client: httpx.AsyncClient | None = None) -> None:
        self._url = url.rstrip("/") + "/api/v1/query"
        self._window_s = window_s
        self._queries = traffic_queries(window_s, model, extra_selector)
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        await self._client.aclose()

    async def _query(self, promql: str) -> float | None:
        try:
            resp = await self._client.get(self._url, params={"query": promql})
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise UnavailableError(f"prometheus at {self._url} unreachable: {exc!r}") from exc
        return scalar_of(body)

    async def sample(self) -> TrafficSample | None:
        names = list(self._queries)
        values = dict(zip(names, await asyncio.gather(*(self._query(self._queries[n]) for n in names)), strict=True))
        if values["num_requests"] is None:
            logger.warning("prometheus has no frontend request count; traffic unknown query=%s", self._queries["num_requests"])
            return None

        def ms(v: float | None) -> float | None:
            return None if v is None else v * 1000.0

        return TrafficSample(
            duration_s=self._window_s,
            num_requests=max(0.0, values["num_requests"]),
            isl=values["isl"],
            osl=values["osl"],
            ttft_ms=ms(values["ttft_s"]),
            itl_ms=ms(values["itl_s"]),
        )
