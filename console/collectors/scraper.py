"""Frontend scraper: fetches each frontend's ``/metrics`` on an interval and hands the text over.

Frontends are found in discovery (role or component ``frontend``; a ``metrics_url`` label wins over
the status server's ``system_url``) plus any ``--frontend-url``. A frontend that stops answering is
forgotten, so its stale figures do not linger in the Models view, and the reason is kept
(``scrape_failed``) so a view with no figures says why instead of a silent ``-``.

Credentials: a member's status server refuses ``/metrics`` without the cluster token, and a
frontend with API keys accepts either the token or one of its keys. The scraper presents what it
was given (token first, then the API key), moves to the next on a 401/403 and remembers per URL
which one was accepted; with nothing accepted the reason names the flag that is missing.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable

import httpx

from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.recording import StateSink
from dynamod.shared.observability.status_server import metrics_auth_headers
from dynamod.shared.security.token import ClusterToken

logger = logging.getLogger(__name__)

FRONTEND_NAMES = frozenset({"frontend", "http"})
REFUSED = frozenset({401, 403})
NO_CREDENTIALS_HINT = "give --api-key-file (or DYN_API_KEY), or --cluster-token-file"


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


class Credential:
    """One way to authenticate a scrape: its name (for messages) and its headers. ``repr`` never
    shows the secret."""

    __slots__ = ("name", "headers")

    def __init__(self, name: str, headers: dict[str, str]) -> None:
        self.name = name
        self.headers = headers

    def __repr__(self) -> str:
        return f"Credential({self.name!r})"


def scrape_credentials(token: ClusterToken | None, api_key: str | None, api_key_source: str = "") -> list[Credential]:
    """What a scrape may present, in the order tried; ``[no credentials]`` when nothing was given."""
    out = []
    if token is not None:
        out.append(Credential("cluster token", metrics_auth_headers(token)))
    if api_key:
        out.append(Credential(f"API key ({api_key_source})" if api_key_source else "API key",
                              {"Authorization": f"Bearer {api_key}"}))
    return out or [Credential("", {})]


def failure_reason(url: str, exc: httpx.HTTPError, tried: list[Credential]) -> str:
    """Why ``url`` gave no figures, in words an operator acts on."""
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        if code in REFUSED:
            names = [c.name for c in tried if c.name]
            if not names:
                return f"{code} from {url}: the frontend wants a key; {NO_CREDENTIALS_HINT}"
            return f"{code} from {url}: the {' and the '.join(names)} given {'was' if len(names) == 1 else 'were'} refused"
        return f"{code} from {url}"
    text = str(exc) or type(exc).__name__
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return f"TLS from {url}: certificate not trusted; give --frontend-ca-file"
    if url.startswith("http://") and isinstance(exc, httpx.RemoteProtocolError):
        return f"no HTTP answer from {url}: an https:// frontend? ({text})"
    return f"no answer from {url}: {text}"


class FrontendHttp:
    """GETs from frontends with the credentials given: the one that worked last for a URL first,
    the next on a 401/403. Shared by the ``/metrics`` scraper and the trace readers
    (``collectors/traces.py``), which a frontend guards with the same keys."""

    def __init__(
        self,
        credentials: list[Credential],
        *,
        timeout_s: float = 2.0,
        ca_file: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: recorded answers
    ) -> None:
        self.credentials = credentials
        self._timeout_s = timeout_s
        self._ca_file = ca_file
        self._transport = transport
        self._accepted: dict[str, int] = {}  # url -> index of the credential it took

    def client(self) -> httpx.AsyncClient:
        """The client every GET goes through: this reader's timeout and TLS trust."""
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=self._ca_file) if self._ca_file else True
        return httpx.AsyncClient(timeout=self._timeout_s, verify=verify, transport=self._transport)

    def forget(self, url: str) -> None:
        self._accepted.pop(url, None)

    async def get(self, client: httpx.AsyncClient, url: str, params: dict[str, str] | None = None) -> httpx.Response:
        """GET with the credential that worked last, then the others on a refusal; raises
        ``httpx.HTTPStatusError`` for the last refusal or any other error status."""
        first = self._accepted.get(url, 0)
        order = self.credentials[first:] + self.credentials[:first]
        for i, cred in enumerate(order):
            resp = await client.get(url, headers=cred.headers, params=params)
            if resp.status_code in REFUSED and i + 1 < len(order):
                continue
            resp.raise_for_status()
            self._accepted[url] = self.credentials.index(cred)
            return resp
        raise AssertionError("unreachable: the last credential's answer is raised or returned")


class FrontendScraper:
    def __init__(
        self,
        sink: StateSink,
        sources: Callable[[], list[str]],
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        token: ClusterToken | None = None,
        api_key: str | None = None,
        api_key_source: str = "",
        ca_file: str | None = None,
        guessed: Iterable[str] = (),
    ) -> None:
        self._sink = sink
        self._http = FrontendHttp(scrape_credentials(token, api_key, api_key_source), timeout_s=timeout_s, ca_file=ca_file)
        self._sources = sources
        self._interval_s = interval_s
        self._guessed = frozenset(guessed)  # URLs tried on a hunch (the local default): silence is fine
        self._failing: dict[str, str] = {}  # url -> the reason last reported
        self._known: set[str] = set()
        self.rounds = 0  # scrape rounds finished (dynamoctl waits for the first)

    async def run(self) -> None:
        async with self.http_client() as client:
            while True:
                await self.scrape_once(client)
                await asyncio.sleep(self._interval_s)

    def http_client(self) -> httpx.AsyncClient:
        """The client every scrape goes through: this scraper's timeout and TLS trust."""
        return self._http.client()

    async def scrape_once(self, client: httpx.AsyncClient) -> None:
        """One round over the current sources (``run`` repeats it on the interval)."""
        urls = self._sources()
        for gone in self._known - set(urls):
            self._sink.forget_source(gone)
            self._failing.pop(gone, None)
            self._http.forget(gone)
        self._known = set(urls)
        if urls:
            await asyncio.gather(*(self._scrape(client, u) for u in urls))
        self.rounds += 1

    async def _scrape(self, client: httpx.AsyncClient, url: str) -> None:
        try:
            resp = await self._http.get(client, url)
        except httpx.HTTPError as exc:
            if url in self._guessed and isinstance(exc, httpx.ConnectError) and "CERTIFICATE" not in str(exc):
                # Nothing listens where `dynamod up` usually serves: not a problem worth a line.
                if url not in self._failing:
                    self._failing[url] = ""
                    self._sink.forget_source(url)
                return
            reason = failure_reason(url, exc, self._http.credentials)
            if self._failing.get(url) != reason:
                self._failing[url] = reason
                logger.info("frontend scrape failed url=%s reason=%s", url, reason)
                self._sink.scrape_failed(url, reason)
            return
        if url in self._failing:
            del self._failing[url]
            logger.info("frontend scrape recovered url=%s", url)
        self._sink.apply_metrics_text(url, resp.text)
