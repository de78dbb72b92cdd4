"""Reading the frontends' ``GET /v1/traces``: one request's spans, and the slowest recent requests.

The frontends are the ones the ``/metrics`` scraper finds (``frontend_metric_urls``: discovery plus
``--frontend-url``), read at the same address with the same credentials (``FrontendHttp``): the
frontend guards ``/v1/traces`` as it guards ``/metrics``. ``SlowestPoller`` asks each for
``?slowest=N`` every few seconds into ``ClusterState.requests``; the console runs it only while the
Requests view is shown, so an idle console costs the frontends nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import httpx

from dynamod.console.collectors.scraper import (
    FrontendHttp,
    failure_reason,
    frontend_metric_urls,
    scrape_credentials,
)
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.traces import (
    RequestBoard,
    RequestSummary,
    Span,
    SpanError,
    parse_spans,
    parse_summary,
)

if TYPE_CHECKING:
    from dynamod.console.settings import ConsoleSettings

logger = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
SLOWEST_DEFAULT = 50
POLL_INTERVAL_S = 3.0


def trace_url(metrics_url: str) -> str:
    """The ``/v1/traces`` beside a frontend's ``/metrics``."""
    base = metrics_url.removesuffix("/metrics").rstrip("/")
    return f"{base}{TRACES_PATH}"


def frontend_trace_urls(state: ClusterState, extra: Iterable[str] = ()) -> list[str]:
    return sorted({trace_url(u) for u in frontend_metric_urls(state, extra)})


def frontend_http(settings: ConsoleSettings, *, timeout_s: float = 3.0) -> FrontendHttp:
    """A reader with the credentials the scraper presents: the cluster token, then the API key."""
    creds = scrape_credentials(settings.security.request_plane.token, settings.api_key, settings.api_key_source)
    return FrontendHttp(creds, timeout_s=timeout_s, ca_file=settings.frontend_ca_file)


def read_failure(url: str, exc: httpx.HTTPError, http: FrontendHttp) -> str:
    """Why a frontend gave no trace answer; a 404 is a frontend without tracing (older build)."""
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 404:
        return f"404 from {url}: this frontend does not serve {TRACES_PATH}"
    return failure_reason(url, exc, http.credentials)


def is_quiet_miss(url: str, exc: httpx.HTTPError, guessed: frozenset[str]) -> bool:
    """Nothing listens where ``dynamod up`` usually serves (a guessed URL): not worth a word."""
    return url in guessed and isinstance(exc, httpx.ConnectError) and "CERTIFICATE" not in str(exc)


def guessed_trace_urls(settings: ConsoleSettings) -> frozenset[str]:
    return frozenset(trace_url(u) for u in settings.guessed_frontend_urls)


async def _get_json(http: FrontendHttp, client: httpx.AsyncClient, url: str, params: dict[str, str]) -> Any:
    resp = await http.get(client, url, params)
    try:
        return resp.json()
    except ValueError:
        raise httpx.DecodingError(f"not JSON ({resp.headers.get('content-type', '?')})") from None


async def fetch_spans(
    http: FrontendHttp, client: httpx.AsyncClient, url: str, params: dict[str, str], guessed: frozenset[str] = frozenset()
) -> tuple[list[Span], list[str]] | None:
    """The spans one frontend holds for ``params`` (``request_id`` or ``trace_id``), and notes on
    what went wrong (the frontend did not answer; a span was malformed); ``None`` when nothing
    listens at a guessed address (no frontend there to speak of). Never raises for the frontend's
    failures: one frontend down must not hide the others' spans."""
    try:
        body = await _get_json(http, client, url, params)
    except httpx.HTTPError as exc:
        return None if is_quiet_miss(url, exc, guessed) else ([], [read_failure(url, exc, http)])
    if not isinstance(body, dict):
        return [], [f"{url}: answer is {type(body).__name__}, not an object"]
    return parse_spans(body.get("data", []), url)


async def fetch_slowest(http: FrontendHttp, client: httpx.AsyncClient, url: str, limit: int) -> list[RequestSummary]:
    """One frontend's slowest recent requests; raises ``httpx.HTTPError`` or ``SpanError``."""
    body = await _get_json(http, client, url, {"slowest": str(limit)})
    rows = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise SpanError(f"{url}: no requests list in the answer")
    out = []
    for row in rows:
        try:
            out.append(parse_summary(row, url))
        except SpanError as exc:
            logger.info("slowest row left out url=%s error=%s", url, exc)
    return out


class SlowestPoller:
    """Polls every frontend's ``?slowest=N`` into a ``RequestBoard`` until cancelled."""

    def __init__(
        self,
        board: RequestBoard,
        sources: Callable[[], list[str]],
        http: FrontendHttp,
        *,
        limit: int = SLOWEST_DEFAULT,
        interval_s: float = POLL_INTERVAL_S,
        guessed: Iterable[str] = (),
    ) -> None:
        self._board = board
        self._guessed = frozenset(guessed)  # trace URLs tried on a hunch: nothing listening is no news
        self._sources = sources
        self._http = http
        self._limit = limit
        self._interval_s = interval_s
        self._known: set[str] = set()
        self.rounds = 0

    async def run(self) -> None:
        async with self._http.client() as client:
            while True:
                await self.poll_once(client)
                await asyncio.sleep(self._interval_s)

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        urls = self._sources()
        for gone in self._known - set(urls):
            self._board.forget(gone)
            self._http.forget(gone)
        self._known = set(urls)
        if not urls:
            self._board.polled_none()
        await asyncio.gather(*(self._poll(client, u) for u in urls))
        self.rounds += 1

    async def _poll(self, client: httpx.AsyncClient, url: str) -> None:
        try:
            rows = await fetch_slowest(self._http, client, url, self._limit)
        except httpx.HTTPError as exc:
            if is_quiet_miss(url, exc, self._guessed):
                self._board.forget(url)
            else:
                self._board.failed(url, read_failure(url, exc, self._http))
            return
        except SpanError as exc:
            self._board.failed(url, str(exc))
            return
        self._board.apply(url, rows)
