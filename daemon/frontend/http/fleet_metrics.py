"""``/metrics`` of a ``--num-frontends N`` fleet: the whole fleet's totals, from whichever member
the kernel hands the scrape to.

The members share one port, so a Prometheus server (or a load balancer in front of it) scraping
that port reaches one member at random. Each member therefore also runs a private status server
(``/metrics`` of that process alone, on an ephemeral port) and advertises it in discovery as its
``metrics_url``, with a ``fleet`` label naming the shared address. The public ``/metrics`` reads
its own registry plus every live peer's private ``/metrics`` and adds them up, so:

- one scrape target on the shared port sees fleet totals, whichever member answers;
- tools that scrape every frontend found in discovery (the console, the planner) follow
  ``metrics_url``, get per-process figures and sum them: nothing is counted twice;
- ``/metrics?scope=process`` on the shared port gives the answering process alone.

How series combine: counters, histograms and summaries add; gauges add (requests in flight,
tasks, memory) except ratios and last-seen values (``*_rate``, ``*_ratio``, ``*_last_*``), which
are averaged over the members, and start times (``*_created``, ``process_start_time_seconds``),
which take the earliest. A peer that does not answer within the timeout is left out and counted
in ``dynamo_frontend_fleet_scrape_errors``; ``dynamo_frontend_fleet_members`` says how many
processes the answer covers. With the cluster token on, the members' private ``/metrics`` refuse
callers without it, so a member sends it to its peers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from dynamod.shared.observability.status_server import metrics_auth_headers
from dynamod.shared.security.token import ClusterToken

if TYPE_CHECKING:
    from dynamod.shared.runtime.client import EndpointClient

logger = logging.getLogger(__name__)

FLEET_LABEL = "fleet"
METRICS_URL_LABEL = "metrics_url"
PEER_TIMEOUT_S = 1.0

_MIN_SAMPLES = ("_created",)
_MIN_NAMES = frozenset({"process_start_time_seconds"})
_MEAN_MARKERS = ("_rate", "_ratio", "_last_")

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def _combine(family: str, family_type: str, sample: str) -> str:
    """``sum``, ``min`` or ``mean``: how one sample adds up across the fleet."""
    if sample.endswith(_MIN_SAMPLES) or sample in _MIN_NAMES:
        return "min"
    if family_type == "gauge" and any(marker in family for marker in _MEAN_MARKERS):
        return "mean"
    return "sum"


class _Family:
    __slots__ = ("documentation", "name", "samples", "type", "unit")

    def __init__(self, metric: Metric) -> None:
        self.name = metric.name
        self.documentation = metric.documentation
        self.type = metric.type
        self.unit = metric.unit
        # key -> [combined value, contributions]
        self.samples: dict[SampleKey, list[float]] = {}


def merge_expositions(texts: Iterable[str]) -> list[Metric]:
    """The metric families of several Prometheus text expositions, combined sample by sample."""
    families: dict[str, _Family] = {}
    for text in texts:
        for metric in text_string_to_metric_families(text):
            family = families.get(metric.name)
            if family is None:
                family = families[metric.name] = _Family(metric)
            for sample in metric.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                how = _combine(family.name, family.type, sample.name)
                slot = family.samples.get(key)
                if slot is None:
                    family.samples[key] = [sample.value, 1]
                elif how == "min":
                    slot[0] = min(slot[0], sample.value)
                    slot[1] += 1
                else:  # sum; a mean is a sum divided below
                    slot[0] += sample.value
                    slot[1] += 1
    out: list[Metric] = []
    for family in families.values():
        metric = Metric(family.name, family.documentation, family.type, family.unit)
        for (name, labels), (value, count) in family.samples.items():
            if _combine(family.name, family.type, name) == "mean":
                value /= count
            metric.add_sample(name, dict(labels), value)
        out.append(metric)
    return out


class _Collected:
    """A collector that yields already-built families (for ``generate_latest``)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


def render(metrics: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected(metrics))  # type: ignore[arg-type]
    return generate_latest(registry)


def _gauge(name: str, documentation: str, value: float) -> Metric:
    metric = Metric(name, documentation, "gauge")
    metric.add_sample(name, {}, value)
    return metric


class FleetMetrics:
    """Answers the shared port's ``/metrics`` for a fleet member (see the module docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        peers: EndpointClient,
        *,
        fleet: str,
        own_instance_id: int,
        timeout_s: float = PEER_TIMEOUT_S,
        token: ClusterToken | None = None,
    ) -> None:
        self._registry = registry
        self._peers = peers
        self.fleet = fleet
        self._own = own_instance_id
        self._http = httpx.AsyncClient(timeout=timeout_s, headers=metrics_auth_headers(token))
        self.scrape_errors = 0

    def _members(self) -> list[Any]:
        return [inst for inst in self._peers.instances if inst.labels.get(FLEET_LABEL) == self.fleet]

    def member_pids(self) -> list[int]:
        """Process ids of the fleet's members found in discovery (all on this host)."""
        return sorted({inst.pid for inst in self._members() if inst.pid})

    def peer_urls(self) -> list[str]:
        """The private ``/metrics`` of the other live members of this fleet."""
        urls = {
            inst.labels.get(METRICS_URL_LABEL, "") for inst in self._members() if inst.instance_id != self._own
        }
        return sorted(url for url in urls if url)

    async def _fetch(self, url: str) -> str | None:
        try:
            response = await self._http.get(url)
            response.raise_for_status()
            return response.text
        except (httpx.HTTPError, OSError) as exc:
            self.scrape_errors += 1
            logger.info("fleet metrics peer unreachable url=%s error=%s", url, exc)
            return None

    async def exposition(self) -> bytes:
        """Fleet totals: this process's registry plus every peer that answered."""
        own = generate_latest(self._registry).decode()
        fetched = await asyncio.gather(*(self._fetch(url) for url in self.peer_urls()))
        texts = [own, *(t for t in fetched if t is not None)]
        metrics = merge_expositions(texts)
        metrics.append(
            _gauge("dynamo_frontend_fleet_members", "Frontend processes whose metrics this answer adds up", len(texts))
        )
        metrics.append(
            _gauge(
                "dynamo_frontend_fleet_scrape_errors",
                "Peer scrapes that failed since this process started (the peer was left out)",
                self.scrape_errors,
            )
        )
        return render(metrics)

    async def close(self) -> None:
        await self._http.aclose()
        await self._peers.close()


def fleet_labels(shared_address: str, status_url: str) -> dict[str, str]:
    """The discovery labels of a fleet member: its own ``/metrics`` and the fleet it belongs to."""
    return {FLEET_LABEL: shared_address, METRICS_URL_LABEL: f"{status_url}/metrics"}


def wants_process_scope(scope: dict[str, Any]) -> bool:
    """``/metrics?scope=process``: the answering process alone."""
    query = scope.get("query_string") or b""
    return b"scope=process" in query.split(b"&")
