"""The OpenAI port's doors with real processes: a mocker worker and a frontend serving HTTPS with
API keys, a rate limit and a small body cap; and the worker refusing what its context cannot hold
whoever calls it.

Listeners touched here (bind address: what it requires):
- frontend OpenAI port (127.0.0.1, or 0.0.0.0 in the warning test): HTTPS with the test CA's node
  certificate; ``Authorization: Bearer KEY`` on every route but ``/live`` (``/health`` answers
  status only without it);
- worker TCP request plane (127.0.0.1): open (no cluster token in this test), limits at defaults.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from dynamod.shared.config import RuntimeSettings
from dynamod.shared.errors import ContextLengthError, InvalidRequestError
from dynamod.shared.runtime.distributed import DistributedRuntime
from tests.fixtures.servers import wait_until
from tests.fixtures.tls import ClusterCerts, make_cluster_certs
from tests.integration.frontend.test_frontend_support import LocalCluster

pytestmark = pytest.mark.timeout(180)

KEY = "test-key-0123456789abcdef"
OTHER_KEY = "other-key-0123456789abcdef"
LATE_KEY = "late-key-0123456789abcdef"
MAX_BODY = 64 * 1024
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class SecureFrontend:
    def __init__(self, cluster: LocalCluster, certs: ClusterCerts, keys_file: Path) -> None:
        self.cluster = cluster
        self.certs = certs
        self.keys_file = keys_file
        self.url = f"https://127.0.0.1:{cluster.http_port}"

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, verify=self.verify(), headers=headers, timeout=30)

    def verify(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.certs.ca)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureFrontend]:
    root = tmp_path_factory.mktemp("frontend-security")
    certs = make_cluster_certs(root / "certs")
    keys_file = root / "api-keys"
    keys_file.write_text(f"# keys of the test\n{KEY}\n\n{OTHER_KEY}\n")
    keys_file.chmod(0o600)
    cluster = LocalCluster(root)
    try:
        cluster.start_worker()
        cluster.start_frontend(
            "--api-key-file", str(keys_file), "--rate-limit", "1", "--rate-limit-burst", "60",
            # These tests send many key-less requests from one address on purpose; key guessing has
            # its own test (tests/security/test_frontend_abuse.py).
            "--auth-failure-burst", "1000",
            "--max-body-bytes", str(MAX_BODY), "--http-tls-cert-file", certs.node_cert,
            "--http-tls-key-file", certs.node_key,
        )
        front = SecureFrontend(cluster, certs, keys_file)

        def ready() -> bool:
            try:
                with front.client(KEY) as c:
                    body = c.get("/health").json()
            except (httpx.HTTPError, ValueError):
                assert cluster.frontend is not None and cluster.frontend.alive(), cluster.frontend.log()
                return False
            return any(m["model"] == "tiny" and m["ready"] for m in body.get("models", []))

        wait_until(ready, 60, interval=0.1, what="the HTTPS frontend with a ready worker")
        yield front
    finally:
        cluster.stop()


def _assert_openai_error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and error["message"] and "Traceback" not in resp.text
    return error


ROUTES = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"), ("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("GET", "/v1/responses/resp_x"),
    ("DELETE", "/v1/responses/resp_x"), ("GET", "/metrics"), ("GET", "/openapi.json"),
]


@pytest.mark.parametrize("key", [None, "wrong-key-0123456789abcdef", "Basic dXNlcjpwYXNz"])
def test_unauthenticated_client_is_refused_at_every_door(secure: SecureFrontend, key: str | None) -> None:
    headers = {"authorization": key} if key and key.startswith("Basic") else {}
    with secure.client(None if key is None or key.startswith("Basic") else key) as c:
        for method, path in ROUTES:
            resp = c.request(method, path, json=CHAT if method == "POST" else None, headers=headers)
            _assert_openai_error(resp, 401, "invalid_api_key")
            assert resp.headers["www-authenticate"].startswith("Bearer")
        # Liveness stays open; health says only that it is healthy: no models, workers, addresses, pids.
        assert c.get("/live").status_code == 200
        health = c.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "healthy"}


def test_authenticated_client_is_served_over_https(secure: SecureFrontend) -> None:
    http_client = httpx.Client(verify=secure.verify())
    api = openai.OpenAI(base_url=secure.url + "/v1", api_key=KEY, http_client=http_client, max_retries=0)
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secure.url + "/v1", api_key="nope-0123456789abcdef", http_client=http_client,
                      max_retries=0).models.list()
    with secure.client(KEY) as c:
        health = c.get("/health").json()
        assert health["instances"] and all("pid" in i and "address" in i for i in health["instances"])
        metrics = c.get("/metrics").text
        assert 'dynamo_frontend_refused_requests_total{reason="unauthenticated"}' in metrics
        assert c.get("/openapi.json").json()["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    # Plain HTTP on the HTTPS port gets no answer it could mistake for a served request.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{secure.cluster.http_port}/live", timeout=5).raise_for_status()


def test_keys_file_is_reloaded_when_it_changes(secure: SecureFrontend) -> None:
    with secure.client(LATE_KEY) as c:
        assert c.get("/v1/models").status_code == 401
        secure.keys_file.write_text(f"{KEY}\n{OTHER_KEY}\n{LATE_KEY}\n")
        wait_until(lambda: c.get("/v1/models").status_code == 200, 10, interval=0.2, what="the new key accepted")


def _raw_https(secure: SecureFrontend, request: bytes) -> bytes:
    ctx = ssl.create_default_context(cafile=secure.certs.ca)
    with socket.create_connection(("127.0.0.1", secure.cluster.http_port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = tls.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data


def test_body_cap_answers_413_before_the_body_is_read(secure: SecureFrontend) -> None:
    # 20 MB announced, not one byte of it sent: the answer comes anyway, and the connection closes.
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n").encode()
    reply = _raw_https(secure, head)
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 413 " in status_line, reply[:300]
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(64):
            yield b" " * 4096

    with secure.client(KEY) as c:
        _assert_openai_error(c.post("/v1/completions", content=chunks()), 413, "request_too_large")
        # Just under the cap is read and judged on its content.
        small = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x " * 1000}]})
        assert c.post("/v1/chat/completions", content=small).status_code == 200


def test_invalid_utf8_and_bad_json_are_400(secure: SecureFrontend) -> None:
    with secure.client(KEY) as c:
        for body in (b'{"model": "tiny", "prompt": "\xff\xfe"}', b'{"model": "tiny", "prompt": "\xed\xa0\x80"}',
                     b'{"model": "tiny", "prompt": "\\ud800"}', b"\xc3\x28"):
            resp = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["error"]["type"] == "invalid_request_error"


def test_rate_limit_answers_429_per_client_key(secure: SecureFrontend) -> None:
    with secure.client(OTHER_KEY) as c, secure.client(KEY) as other:
        statuses = [c.get("/v1/models") for _ in range(80)]
        limited = [r for r in statuses if r.status_code == 429]
        assert limited and statuses[0].status_code == 200
        error = _assert_openai_error(limited[0], 429, "rate_limit_exceeded")
        assert "rate limit" in error["message"].lower()
        assert int(limited[0].headers["retry-after"]) >= 1
        # Another key has its own bucket; probes are not counted.
        assert other.get("/v1/models").status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/live").status_code == 200
        assert 'reason="rate_limited"' in other.get("/metrics").text


async def _generate(cluster: LocalCluster, body: dict) -> list:
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(cluster.file_kv), event_plane="zmq")
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        client = await rt.namespace().component("backend").endpoint("generate").client()
        await client.wait_for_instances(1, 10)
        return await client.call(body)
    finally:
        await rt.shutdown(grace_s=0.5)


def test_worker_refuses_what_its_context_cannot_hold_whoever_calls(secure: SecureFrontend) -> None:
    with secure.client(KEY) as c:
        context = c.get("/v1/models/tiny").json()["max_model_len"]
    base = {"request_id": "direct-1", "model": "tiny"}
    with pytest.raises(ContextLengthError, match="maximum context length"):
        asyncio.run(_generate(secure.cluster, {**base, "token_ids": [5] * context}))
    with pytest.raises(ContextLengthError, match="maximum context length"):
        asyncio.run(_generate(secure.cluster, {**base, "token_ids": [5] * 10, "stop": {"max_tokens": context}}))
    for bad in ({"token_ids": [5], "stop": {"max_tokens": 0}}, {"token_ids": []},
                {"token_ids": [5], "stop": {"max_tokens": 4, "min_tokens": 9}}):
        with pytest.raises(InvalidRequestError):
            asyncio.run(_generate(secure.cluster, {**base, **bad}))
    out = asyncio.run(_generate(secure.cluster, {**base, "token_ids": [5] * 10, "stop": {"max_tokens": 2}}))
    assert sum(len(o.get("token_ids", [])) for o in out) == 2


def test_wide_listener_without_keys_warns_at_start(tmp_path: Path) -> None:
    wide = LocalCluster(tmp_path / "wide").start_frontend("--http-host", "0.0.0.0")
    loopback = LocalCluster(tmp_path / "loopback").start_frontend()
    try:
        for proc in (wide, loopback):
            wait_until(lambda p=proc: "frontend listening" in p.log() or not p.alive(), 30, interval=0.1,
                       what=f"{proc.name} to start")
        assert "without API keys host=0.0.0.0" in wide.log()
        assert "without API keys" not in loopback.log()
    finally:
        wide.stop()
        loopback.stop()
