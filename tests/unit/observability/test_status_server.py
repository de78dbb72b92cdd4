"""The status server's stop and its busy port (repairs found in review: each test fails without
its repair). That a busy port also releases the half-built runtime: tests/unit/runtime/test_distributed.py."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry

from dynamod.shared.errors import ConfigError
from dynamod.shared.observability.status_server import StatusServer


async def test_status_server_stop_closes_a_scrapers_keepalive_connection() -> None:
    """Python 3.12+ wait_closed() waits for open connections: a Prometheus scraper's keep-alive
    connection would hold shutdown (and the lease revocation after it) for ever."""
    server = StatusServer(CollectorRegistry(), lambda: (True, {}), port=0)
    url = await server.start()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"200 OK" in head and b"keep-alive" in head.lower()
        await asyncio.wait_for(reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])), 5)
        await asyncio.wait_for(server.stop(), 5)
        # The server hung up on the idle scraper instead of waiting up to 30 s for its next request.
        assert await asyncio.wait_for(reader.read(), 2) == b""
    finally:
        writer.close()


async def test_busy_status_port_is_a_config_error_naming_the_flag() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        server = StatusServer(CollectorRegistry(), lambda: (True, {}), port=holder.getsockname()[1])
        with pytest.raises(ConfigError, match="--system-port") as err:
            await server.start()
        assert str(holder.getsockname()[1]) in str(err.value)
    finally:
        holder.close()


async def test_a_fleet_members_traces_route_takes_the_cluster_token_and_the_frontends_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``--num-frontends`` member advertises its status server, so its spans are read there: the
    frontend's own handler (``traces_reply``: same queries, same JSON), refused without the token."""
    import httpx

    from dynamod.daemon.frontend.app import traces_reply
    from dynamod.shared.observability import tracing
    from dynamod.shared.security.token import ClusterToken

    # A ring of its own: the process's ring holds earlier tests' requests, slower than this one,
    # and ``slowest=5`` would list those instead (the clean-clone run at 2c66ae8 failed so).
    monkeypatch.setattr(tracing.tracer(), "ring", tracing.SpanRing(100, 1000))
    token = ClusterToken("status-token-0123456789abcdef")
    rid = "status-route-rid-1"
    root = tracing.tracer().start_span(tracing.SPAN_HTTP_REQUEST, component="frontend", sampled=True,
                                       attributes={"request_id": rid, "model": "tiny"})
    root.end()
    server = StatusServer(CollectorRegistry(), lambda: (True, {}), port=0, token=token)
    server.add_route("/v1/traces", traces_reply)
    with pytest.raises(ValueError, match="own route"):
        server.add_route("/metrics", traces_reply)
    url = await server.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            refused = await client.get("/v1/traces", params={"request_id": rid})
            assert refused.status_code == 401 and "/v1/traces needs the cluster token" in refused.json()["error"]["message"]
            wrong = await client.get("/v1/traces", params={"request_id": rid}, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            auth = {"Authorization": f"Bearer {token.value}"}
            got = await client.get("/v1/traces", params={"request_id": rid}, headers=auth)
            assert got.status_code == 200 and got.headers["content-type"] == "application/json"
            [span] = got.json()["data"]
            assert span["span_id"] == root.span_id and span["attributes"]["request_id"] == rid
            slowest = await client.get("/v1/traces", params={"slowest": "5"}, headers=auth)
            assert rid in [r["request_id"] for r in slowest.json()["requests"]]
            bad = await client.get("/v1/traces", params={"limit": "x", "request_id": rid}, headers=auth)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
            assert (await client.get("/live")).status_code == 200  # still open
    finally:
        await server.stop()
