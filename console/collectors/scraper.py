"""Frontend scraper: fetches each frontend's ``/metrics`` on an interval and hands the text over.

Frontends are found in discovery (role or component ``frontend``; a ``metrics_url`` label wins over
the status server's ``system_url``) plus any ``--frontend-url``. A frontend that stops answering is
forgotten, so its stale figures do not linger in the Models view.

Every scrape carries the cluster token when the console has one: a member's status server refuses
``/metrics`` without it, and a frontend with API keys accepts it on its ``/metrics`` in place of a key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import httpx

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import StateSink
from dynamod.shared.observability.status_server import metrics_auth_headers
from dynamod.shared.security.token import ClusterToken

logger = logging.getLogger(__name__)

FRONTEND_NAMES = frozenset({"frontend", "http"})


def frontend_metric_urls(state: ClusterState, extra: Iterable[str] = ()) -> list[str]:
    urls = {u if u.endswith("/metrics") else f"{u}/metrics" for u in extra}
    for w in state.workers.values():
        if w.gone_at is not None:
            continue
        if w.role in FRONTEND_NAMES or w.component in FRONTEND_NAMES:
            url = w.labels.get("metrics_url") or (f"{w.system_url}/metrics" if w.system_url else "")
            if url:
                urls.add(url)
    return sorted(urls)


class FrontendScraper:
    def __init__(
        self,
        sink: StateSink,
        sources: Callable[[], list[str]],
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        token: ClusterToken | None = None,
    ) -> None:
        self._sink = sink
        self._headers = metrics_auth_headers(token)
        self._sources = sources
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._failing: set[str] = set()
        self._known: set[str] = set()

    async def run(self) -> None:
        async with self.http_client() as client:
            while True:
                await self.scrape_once(client)
                await asyncio.sleep(self._interval_s)

    def http_client(self) -> httpx.AsyncClient:
        """The client every scrape goes through: this scraper's timeout and, with a token, its header."""
        return httpx.AsyncClient(timeout=self._timeout_s, headers=self._headers)

    async def scrape_once(self, client: httpx.AsyncClient) -> None:
        """One round over the current sources (``run`` repeats it on the interval)."""
        urls = self._sources()
        for gone in self._known - set(urls):
            self._sink.forget_source(gone)
        self._known = set(urls)
        if urls:
            await asyncio.gather(*(self._scrape(client, u) for u in urls))

    async def _scrape(self, client: httpx.AsyncClient, url: str) -> None:
        try:
            resp = await client.get(url)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            if url not in self._failing:
                self._failing.add(url)
                logger.info("frontend scrape failed url=%s error=%s", url, exc)
                self._sink.forget_source(url)
            return
        if url in self._failing:
            self._failing.discard(url)
            logger.info("frontend scrape recovered url=%s", url)
        self._sink.apply_metrics_text(url, resp.text)
