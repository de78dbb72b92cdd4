"""Frontend scraper: fetches each frontend's ``/metrics`` on an interval and hands the text over.

Frontends are found in discovery (role or component ``frontend``; a ``metrics_url`` label wins over
the status server's ``system_url``) plus any ``--frontend-url``. A frontend that stops answering is
forgotten, so its stale figures do not linger in the Models view.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import httpx

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import StateSink

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
    def __init__(self, sink: StateSink, sources: Callable[[], list[str]], *, interval_s: float = 2.0, timeout_s: float = 2.0) -> None:
        self._sink = sink
        self._sources = sources
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._failing: set[str] = set()
        self._known: set[str] = set()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self._timeout_s) as client:
            while True:
                urls = self._sources()
                for gone in self._known - set(urls):
                    self._sink.forget_source(gone)
                self._known = set(urls)
                if urls:
                    await asyncio.gather(*(self._scrape(client, u) for u in urls))
                await asyncio.sleep(self._interval_s)

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
