"""``traceparent`` and ``x-request-id`` ride in the request-plane frame headers over both
transports (TCP, and NATS against a real nats-server): a stream opened while a span is current
reaches the handler with that span as its parent; a caller's own header is kept; no span, no
header."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from dynamod.shared.observability import tracing
from dynamod.shared.transport.factory import make_client, make_server
from dynamod.shared.transport.plane import RequestContext
from tests.fixtures.servers import NatsServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    with NatsServer(jetstream=False) as server:
        yield server


async def _headers(body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, str]]:
    yield dict(ctx.headers)


@pytest.mark.parametrize("transport", ["tcp", "nats"])
async def test_current_span_reaches_the_handler(transport: str, nats: NatsServer) -> None:
    url = nats.url if transport == "nats" else None
    server = make_server(transport, nats_url=url)
    server.register("t/echo/headers/1", _headers)
    address = await server.start()
    client = make_client(nats_url=url)
    try:
        span = tracing.Tracer().start_span(
            "client_request", component="frontend", sampled=True, attributes={"request_id": "req-9"}
        )
        with tracing.use_span(span):
            stream = client.stream(address, "t/echo/headers/1", None, headers={"x-other": "1"})
        [got] = [h async for h in stream]
        ctx = tracing.headers_context(got)
        assert ctx is not None and (ctx.trace_id, ctx.span_id, ctx.sampled) == (span.trace_id, span.span_id, True)
        assert got["x-request-id"] == "req-9" and got["x-other"] == "1"
        # An unsampled span says so: the worker records nothing.
        quiet = tracing.Tracer(sampler=tracing.Sampler(0.0)).start_span("http-request", component="frontend")
        with tracing.use_span(quiet):
            stream = client.stream(address, "t/echo/headers/1", None)
        [got] = [h async for h in stream]
        assert tracing.headers_context(got).sampled is False  # type: ignore[union-attr]
        # The caller's own traceparent wins; without a current span nothing is added.
        own = f"00-{'a' * 32}-{'b' * 16}-01"
        with tracing.use_span(span):
            stream = client.stream(address, "t/echo/headers/1", None, headers={"traceparent": own})
        [got] = [h async for h in stream]
        assert got["traceparent"] == own
        [got] = [h async for h in client.stream(address, "t/echo/headers/1", None)]
        assert "traceparent" not in got and "x-request-id" not in got
    finally:
        await client.close()
        await server.stop(grace_s=0.5)
