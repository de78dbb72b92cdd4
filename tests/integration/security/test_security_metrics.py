"""``/metrics`` with the cluster token on: status servers serve it to members only, and every reader
in the tree (the console's scraper, the planner's traffic reader, a frontend fleet adding up its
members) presents the token. The frontend's OpenAI port, behind API keys, takes the token on
``/metrics`` in place of a key and nowhere else.

The first tests drive one status server in-process; the rest run a real cluster: a mocker worker
with a status port and a ``--num-frontends 2`` fleet behind an API key, all with the token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from dynamod.console.collectors.scraper import FrontendScraper
from dynamod.console.state.cluster import ClusterState
from dynamod.daemon.planner.traffic import FrontendScrape
from dynamod.shared.config import DEFAULT_NAMESPACE
from dynamod.shared.discovery.factory import make_store
from dynamod.shared.errors import UnavailableError
from dynamod.shared.observability.status_server import StatusServer, metrics_auth_headers
from dynamod.shared.security.token import ClusterToken
from tests.fixtures.servers import free_port, wait_until
from tests.integration.frontend.test_frontend_support import CLI, LocalCluster, Proc

pytestmark = pytest.mark.timeout(180)

TOKEN = ClusterToken("metrics-token-" + "0123456789abcdef")
API_KEY = "sk-metrics-test-" + "0123456789abcdef"


# -- one status server, in-process --------------------------------------------------------------


@pytest.fixture
async def status_url() -> Iterator[str]:
    registry = CollectorRegistry()
    Counter("dynamo_component_test_requests", "a series only members may read", registry=registry).inc(3)
    server = StatusServer(registry, lambda: (True, {"inflight": 0}), token=TOKEN)
    url = await server.start()
    yield url
    await server.stop()


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_token"),
        ({"Authorization": "Bearer wrong-token-0123456789abcdef"}, "bad_token"),
        ({"Authorization": TOKEN.value}, "missing_token"),  # no scheme: not a bearer credential
        ({"Authorization": f"Basic {TOKEN.value}"}, "missing_token"),
    ],
)
async def test_status_server_refuses_metrics_without_the_token(status_url: str, headers: dict, code: str) -> None:
    async with httpx.AsyncClient(base_url=status_url, timeout=5) as http:
        resp = await http.get("/metrics", headers=headers)
        head = await http.head("/metrics", headers=headers)
    assert resp.status_code == 401 and head.status_code == 401
    assert resp.headers["www-authenticate"].startswith("Bearer")
    error = resp.json()["error"]
    assert error["code"] == code and "cluster token" in error["message"] and "Authorization: Bearer" in error["message"]
    assert "dynamo_component_test_requests" not in resp.text and head.content == b""


async def test_status_server_serves_metrics_with_the_token_and_probes_without(status_url: str) -> None:
    async with httpx.AsyncClient(base_url=status_url, timeout=5) as http:
        # One keep-alive connection: a refusal does not end it, the next request is served.
        assert (await http.get("/metrics")).status_code == 401
        resp = await http.get("/metrics", headers=metrics_auth_headers(TOKEN))
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        assert "dynamo_component_test_requests_total 3.0" in resp.text
        assert (await http.get("/live")).status_code == 200
        assert (await http.get("/health")).status_code == 200


async def test_status_server_without_a_token_keeps_metrics_open() -> None:
    """Off by default, as on the loopback dev cluster; and a reader without a token sends no header."""
    server = StatusServer(CollectorRegistry(), lambda: (True, {}))
    url = await server.start()
    try:
        assert metrics_auth_headers(None) == {}
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(url + "/metrics")).status_code == 200
    finally:
        await server.stop()


# -- a real cluster with the token ------------------------------------------------------------


class TokenCluster:
    """A mocker worker (status port) and a two-member frontend fleet behind an API key, all with
    the cluster token in their environment."""

    def __init__(self, root: Path) -> None:
        self.base = LocalCluster(root)
        token_file = root / "cluster.token"
        token_file.write_text(TOKEN.value + "\n")
        token_file.chmod(0o600)
        keys_file = root / "api.keys"
        keys_file.write_text(API_KEY + "\n")
        keys_file.chmod(0o600)
        self.base.env["DYN_CLUSTER_TOKEN_FILE"] = str(token_file)
        self.worker = self.base.start_worker()
        self.worker_url = f"http://127.0.0.1:{self.base.worker_status_ports[self.worker.name]}"
        self.http_port = free_port()
        self.frontend = Proc(
            "fleet",
            [*CLI, "--role", "frontend", *self.base.runtime_flags(), "--http-port", str(self.http_port),
             "--num-frontends", "2", "--api-key-file", str(keys_file), "--worker-wait", "5"],
            self.base.env,
            root,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def member_metrics_urls(self) -> list[str]:
        """The fleet members' own ``/metrics`` (their status servers), from file discovery."""
        urls = []
        for path in (self.base.file_kv / "keys").glob("v1%2Finstances%2F*%2Ffrontend%2Fhttp%2F*"):
            lines = path.read_text().splitlines()
            labels = (json.loads(lines[-1]) if lines else {}).get("labels") or {}
            if labels.get("fleet") == self.url:
                urls.append(labels["metrics_url"])
        return sorted(urls)

    def complete(self, n: int) -> None:
        for _ in range(n):
            with httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as fresh:
                reply = fresh.post("/v1/completions",
                                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
                assert reply.status_code == 200, reply.text

    def requests_total(self) -> float:
        """Requests the whole fleet finished (its shared ``/metrics``)."""
        text = httpx.get(self.url + "/metrics", headers=metrics_auth_headers(TOKEN), timeout=10).text
        return sum(
            s.value for f in text_string_to_metric_families(text) if f.name == "dynamo_frontend_requests"
            for s in f.samples if s.name.endswith("_total")
        )

    def wait_ready(self) -> None:
        def ready() -> bool:
            for proc in (self.worker, self.frontend):
                if not proc.alive():
                    raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
            try:
                health = httpx.get(self.url + "/health", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
            except httpx.HTTPError:
                return False
            models = health.json().get("models", [])
            workers_ready = any(w["status"] == "ready" for m in models for w in m["workers"])
            return workers_ready and len(self.member_metrics_urls()) == 2

        wait_until(ready, 90, interval=0.2, what="a ready worker and both fleet members advertised")

    def stop(self) -> None:
        self.frontend.stop()
        self.worker.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenCluster]:
    c = TokenCluster(tmp_path_factory.mktemp("metrics-token"))
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def _value(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def test_worker_status_server_needs_the_token_for_metrics_only(cluster: TokenCluster) -> None:
    refused = httpx.get(cluster.worker_url + "/metrics", timeout=5)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_token"
    served = httpx.get(cluster.worker_url + "/metrics", headers=metrics_auth_headers(TOKEN), timeout=5)
    assert served.status_code == 200 and "dynamo_component_" in served.text
    assert httpx.get(cluster.worker_url + "/live", timeout=5).status_code == 200
    assert httpx.get(cluster.worker_url + "/health", timeout=5).status_code == 200


def test_frontend_port_takes_the_token_on_metrics_in_place_of_a_key(cluster: TokenCluster) -> None:
    member = metrics_auth_headers(TOKEN)
    assert httpx.get(cluster.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(cluster.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).status_code == 200
    assert httpx.get(cluster.url + "/metrics", headers=member, timeout=10).status_code == 200
    # The token is no API key: the API itself still refuses it.
    models = httpx.get(cluster.url + "/v1/models", headers=member, timeout=10)
    assert models.status_code == 401 and models.json()["error"]["code"] == "invalid_api_key"


def test_fleet_metrics_reach_the_members_with_the_token(cluster: TokenCluster) -> None:
    """Each member's own ``/metrics`` refuses strangers; the shared port still adds both up, so the
    member answering it presented the token to its peer."""
    for url in cluster.member_metrics_urls():
        assert httpx.get(url, timeout=5).status_code == 401
    for _ in range(4):  # whichever member answers
        with httpx.Client(timeout=10, headers=metrics_auth_headers(TOKEN)) as fresh:
            text = fresh.get(cluster.url + "/metrics").text
        assert _value(text, "dynamo_frontend_fleet_members") == 2, text[-2000:]
        assert _value(text, "dynamo_frontend_fleet_scrape_errors") == 0


async def test_console_scraper_reads_the_members_with_the_token(cluster: TokenCluster) -> None:
    urls = [*cluster.member_metrics_urls(), cluster.url + "/metrics"]
    for token, expected in ((TOKEN, urls), (None, [])):
        state = ClusterState()
        scraper = FrontendScraper(state, lambda: list(urls), token=token)
        async with scraper.http_client() as client:
            await scraper.scrape_once(client)
        assert state.frontends.sources == sorted(expected), token


async def test_planner_traffic_reads_the_members_with_the_token(cluster: TokenCluster) -> None:
    store = make_store("file", file_root=str(cluster.base.file_kv))
    await store.start()
    try:
        without = FrontendScrape(store, DEFAULT_NAMESPACE)
        await without.start()
        assert len(without.urls()) == 2
        with pytest.raises(UnavailableError, match="401"):
            await without.sample()
        await without.close()

        scrape = FrontendScrape(store, DEFAULT_NAMESPACE, token=TOKEN)
        await scrape.start()  # the baseline
        before = await asyncio.to_thread(cluster.requests_total)
        await asyncio.to_thread(cluster.complete, 3)
        await asyncio.to_thread(
            wait_until, lambda: cluster.requests_total() == before + 3, 10, 0.05, "the 3 requests counted"
        )
        sample = await scrape.sample()
        await scrape.close()
        assert sample is not None and sample.num_requests == 3
    finally:
        await store.close()
