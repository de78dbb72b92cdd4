"""The per-process status server with the cluster token: ``/health`` maps the cluster (served
endpoints, instance ids) only for callers presenting the token; probes keep their status code."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from dynamod.shared.observability.status_server import StatusServer, bearer_token
from dynamod.shared.security.token import ClusterToken

TOKEN = ClusterToken("member-token-0123456789abcdef")
DETAIL = {"endpoints": [{"endpoint": "ns/worker/generate", "instance_id": "7f3a", "status": "ready"}],
          "inflight": 3, "workers": 2}


async def get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture
async def servers():
    made: list[StatusServer] = []

    async def make(token: ClusterToken | None, ready: bool = True) -> str:
        server = StatusServer(CollectorRegistry(), lambda: (ready, dict(DETAIL)), token=token)
        made.append(server)
        return await server.start()

    yield make
    for server in made:
        await server.stop()


async def test_health_without_the_token_shows_status_only(servers) -> None:
    url = await servers(TOKEN)
    for headers in (None, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN.value}):
        status, body = await get(url, "/health", headers)
        assert status == 200
        assert body == {"status": "ready", "inflight": 3}, headers


async def test_health_with_the_token_shows_the_details(servers) -> None:
    url = await servers(TOKEN)
    status, body = await get(url, "/health", {"Authorization": f"Bearer {TOKEN.value}"})
    assert status == 200 and body == {"status": "ready", **DETAIL}


async def test_probe_status_code_needs_no_token(servers) -> None:
    url = await servers(TOKEN, ready=False)
    status, body = await get(url, "/health")
    assert status == 503 and body == {"status": "notready", "inflight": 3}
    assert (await get(url, "/live"))[0] == 200


async def test_without_a_token_everyone_sees_the_details(servers) -> None:
    """Off by default, as on the loopback dev cluster."""
    url = await servers(None)
    assert (await get(url, "/health"))[1] == {"status": "ready", **DETAIL}


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"GET / HTTP/1.1\r\nAuthorization: Bearer abc\r\n\r\n", b"abc"),
        (b"GET / HTTP/1.1\r\nauthorization:   bearer   abc  \r\n\r\n", b"abc"),
        (b"GET / HTTP/1.1\r\nAuthorization: Basic abc\r\n\r\n", None),
        (b"GET / HTTP/1.1\r\nAuthorization: Bearer\r\n\r\n", None),
        (b"GET /Authorization: Bearer abc HTTP/1.1\r\n\r\n", None),  # the request line is not a header
    ],
)
def test_bearer_token_parsing(head: bytes, expected: bytes | None) -> None:
    assert bearer_token(head) == expected


async def test_runtime_status_server_hides_instances_without_the_token(tmp_path) -> None:
    from dynamod.shared.config import RuntimeSettings
    from dynamod.shared.runtime.distributed import DistributedRuntime
    from dynamod.shared.security.settings import RequestPlaneSecurity, SecuritySettings

    settings = RuntimeSettings(
        discovery_backend="file", file_kv=str(tmp_path / "kv"), event_plane="zmq", system_port=0,
        security=SecuritySettings(request_plane=RequestPlaneSecurity(token=TOKEN)),
    )
    rt = await DistributedRuntime.create(settings, events=False)
    try:
        async def handler(request, context):
            yield request

        await rt.namespace("ns").component("worker").endpoint("generate").serve(handler)
        _, public = await get(rt.status_url, "/health")
        _, member = await get(rt.status_url, "/health", {"Authorization": f"Bearer {TOKEN.value}"})
        assert "endpoints" not in public and set(public) == {"status", "inflight"}
        assert member["endpoints"][0]["instance_id"] == f"{rt.instance_id:x}"
    finally:
        await rt.shutdown(grace_s=0)
