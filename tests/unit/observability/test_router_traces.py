"""The standalone router role's spans (in-process, fake workers): it continues the caller's trace,
records its prefill and routing decisions, hands its own span to the workers as their parent, and
serves what it holds on its ``traces`` endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from dynamod.daemon.router.core.disagg_policy import DisaggPolicyConfig
from dynamod.shared.observability import tracing
from dynamod.shared.observability.tracing import SpanRing
from dynamod.shared.protocol import control
from dynamod.shared.protocol.llm import PreprocessedRequest, StopConditions
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.disagg_cluster import FakePrefill
from tests.unit.frontend.test_app import FakeWorker
from tests.unit.router.test_router_disagg import PROMPT, RouterCluster, _call, _lease, _wait


@dataclass
class HeaderWorker(FakeWorker):
    headers: list[dict[str, str]] = field(default_factory=list)

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.headers.append(dict(ctx.headers))
        async for out in super().handler(body, ctx):
            yield out


@dataclass
class HeaderPrefill(FakePrefill):
    headers: list[dict[str, str]] = field(default_factory=list)

    async def handler(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict]:
        self.headers.append(dict(ctx.headers))
        async for out in super().handler(body, ctx):
            yield out


@pytest.fixture
async def cluster() -> AsyncIterator[RouterCluster]:
    tr = tracing.tracer()
    saved = tr.ring
    tr.ring = SpanRing()
    c = RouterCluster(DisaggPolicyConfig())
    await c.start()
    try:
        yield c
    finally:
        await c.stop()
        tr.ring = saved


async def test_router_continues_the_trace_and_parents_the_workers(cluster: RouterCluster) -> None:
    decode = HeaderWorker(await _lease(cluster))
    prefill = HeaderPrefill(await _lease(cluster))
    await cluster.add("backend", decode, "decode")
    await cluster.add("prefill", prefill, "prefill")
    assert cluster.service is not None
    await _wait(lambda: cluster.service.prefill.routable())  # type: ignore[union-attr]
    await cluster.service._wait_for_workers()
    caller = tracing.tracer().start_span(
        "client_request", component="frontend", sampled=True, attributes={"request_id": "rt-1", "model": "tiny"}
    )
    request = PreprocessedRequest(request_id="engine-1", model="tiny", token_ids=PROMPT, stop=StopConditions(max_tokens=3))
    with tracing.use_span(caller):
        outs = await _call(cluster, "generate", request)
    assert outs[-1]["finish_reason"] == "length"
    caller.end()

    [reply] = await _call(cluster, control.TRACES, control.encode_body(control.TracesRequest(request_id="rt-1")))
    spans = {s["name"]: s for s in reply["spans"] if s["component"] == "router"}
    payload = spans["handle_payload"]
    assert payload["parent_id"] == caller.span_id and payload["trace_id"] == caller.trace_id
    assert payload["attributes"]["request_id"] == "rt-1" and payload["attributes"]["engine_request_id"] == "engine-1"
    assert payload["attributes"]["worker_id"] == worker_id_hex(decode.id)
    assert spans["route"]["parent_id"] == payload["span_id"] and spans["route"]["attributes"]["stage"] == "decode"
    assert "router.overlap_blocks" in spans["route"]["attributes"]
    assert spans["prefill"]["parent_id"] == payload["span_id"]
    assert spans["prefill"]["attributes"]["remote"] is True
    assert spans["prefill"]["attributes"]["worker_id"] == worker_id_hex(prefill.id)
    # The workers were told who called them, and for which client request.
    to_decode = tracing.headers_context(decode.headers[0])
    to_prefill = tracing.headers_context(prefill.headers[0])
    assert to_decode is not None and to_decode.span_id == payload["span_id"]
    assert to_prefill is not None and to_prefill.span_id == spans["prefill"]["span_id"]
    assert decode.headers[0]["x-request-id"] == "rt-1"
