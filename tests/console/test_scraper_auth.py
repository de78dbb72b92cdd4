"""The console's frontend scraper against a real HTTP(S) server that asks for credentials the way a
frontend with API keys does (issue 24 item 10): which credential is presented, what is said when
none is accepted, and an https:// frontend with a private CA (``--frontend-ca-file``)."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dynamod.console.collectors.scraper import FrontendScraper
from dynamod.console.state.cluster import ClusterState
from dynamod.shared.security.token import ClusterToken
from tests.fixtures.tls import make_cluster_certs

KEY = "console-key-0123456789abcdef"
TOKEN = ClusterToken("cluster-token-0123456789abcdef0123")
METRICS = '# TYPE dynamo_frontend_inflight_requests gauge\ndynamo_frontend_inflight_requests{model="tiny"} 3\n'


class _Server:
    def __init__(self, accepted: set[str], context: ssl.SSLContext | None = None) -> None:
        seen: list[str] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                presented = self.headers.get("Authorization", "")
                seen.append(presented)
                ok = presented.removeprefix("Bearer ") in accepted
                body = METRICS.encode() if ok else b'{"error": {"message": "missing or invalid API key"}}'
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if context is not None:
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if context is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def keyed_frontend() -> Iterator[_Server]:
    server = _Server({KEY})
    yield server
    server.close()


async def _scrape(url: str, **kw: object) -> tuple[ClusterState, FrontendScraper]:
    state = ClusterState()
    scraper = FrontendScraper(state, lambda: [url], **kw)  # type: ignore[arg-type]
    async with scraper.http_client() as client:
        await scraper.scrape_once(client)
        await scraper.scrape_once(client)
    return state, scraper


async def test_the_api_key_is_presented_after_a_refused_token_and_remembered(keyed_frontend: _Server) -> None:
    state, _ = await _scrape(keyed_frontend.url, token=TOKEN, api_key=KEY, api_key_source="DYN_API_KEY")
    assert state.metric_problems() == [] and state.model_stats()["tiny"].inflight == 3
    # First round: token (refused), then key; second round: the key straight away.
    assert keyed_frontend.seen == [f"Bearer {TOKEN.value}", f"Bearer {KEY}", f"Bearer {KEY}"]


async def test_without_a_key_the_reason_names_the_flag(keyed_frontend: _Server) -> None:
    state, _ = await _scrape(keyed_frontend.url)
    assert state.metric_problems() == [
        f"401 from {keyed_frontend.url}: the frontend wants a key; give --api-key-file (or DYN_API_KEY), "
        "or --cluster-token-file"
    ]
    state, _ = await _scrape(keyed_frontend.url, token=TOKEN)
    assert state.metric_problems() == [f"401 from {keyed_frontend.url}: the cluster token given was refused"]


async def test_an_https_frontend_with_a_private_ca(tmp_path: Path) -> None:
    certs = make_cluster_certs(tmp_path / "certs")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.node_cert, certs.node_key)
    server = _Server({""}, context)  # an open /metrics, over TLS
    try:
        state, _ = await _scrape(server.url)
        assert state.metric_problems() == [f"TLS from {server.url}: certificate not trusted; give --frontend-ca-file"]
        state, _ = await _scrape(server.url, ca_file=certs.ca)
        assert state.metric_problems() == [] and state.model_stats()["tiny"].inflight == 3
    finally:
        server.close()
