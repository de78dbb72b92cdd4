"""The frontend's side of request traces, on the in-process cluster (real frontend, fake workers):
``x-request-id`` accepted or made, echoed, refused when malformed; the spans of a request under
``GET /v1/traces``, parented, with the ``traceparent`` the worker received; a migrated request kept
with both workers even when it was not sampled; the slowest-requests summary."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from dynamod.shared.observability import tracing
from dynamod.shared.observability.tracing import Sampler, SpanRing
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.transport.plane import RequestContext
from tests.unit.frontend.test_app import Cluster, FakeWorker


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    tr = tracing.tracer()
    saved = (tr.sampler, tr.ring)
    tr.ring = SpanRing()
    c = Cluster()
    await c.start()
    try:
        yield c
    finally:
        await c.stop()
        tr.sampler, tr.ring = saved


def _completion(max_tokens: int = 4) -> dict:
    return {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens}


async def test_request_id_echoed_and_spans_served(cluster: Cluster) -> None:
    seen: list[dict[str, str]] = []
    assert cluster.rt is not None
    worker = FakeWorker(await cluster.rt.create_lease())

    async def recording(body: dict, ctx: RequestContext) -> AsyncIterator[dict]:
        seen.append(dict(ctx.headers))
        async for out in worker.handler(body, ctx):
            yield out

    await cluster.serve(recording, worker.lease)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as http:
        # The client's id is echoed, on success and on every refusal.
        ok = await http.post("/v1/completions", json=_completion(), headers={"x-request-id": "client-id-1"})
        assert ok.status_code == 200 and ok.headers["x-request-id"] == "client-id-1"
        missing = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"x-request-id": "r2"})
        assert missing.status_code == 404 and missing.headers["x-request-id"] == "r2"
        # Without one the frontend makes one, and still echoes it.
        made = await http.post("/v1/completions", json=_completion())
        assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
        # A malformed id is a 400 naming the header.
        for bad in ("x" * 129, "two words\tbad"):
            refused = await http.post("/v1/completions", json=_completion(), headers={"x-request-id": bad})
            assert refused.status_code == 400, bad
            assert "x-request-id" in refused.json()["error"]["message"]

        data = (await http.get("/v1/traces", params={"request_id": "client-id-1"})).json()
        assert data["object"] == "list"
        spans = {s["name"]: s for s in data["data"]}
        assert {"http-request", "preprocess", "route", "client_request"} <= set(spans), set(spans)
        root = spans["http-request"]
        assert root["parent_id"] is None and root["component"] == "frontend" and root["status"] == "ok"
        for name in ("preprocess", "route", "client_request"):
            assert spans[name]["parent_id"] == root["span_id"] and spans[name]["trace_id"] == root["trace_id"]
            assert spans[name]["attributes"]["request_id"] == "client-id-1"
            assert spans[name]["attributes"]["model"] == "tiny"
        attempt = spans["client_request"]
        assert root["start_unix_ns"] <= attempt["start_unix_ns"] <= attempt["end_unix_ns"] <= root["end_unix_ns"]
        assert root["attributes"]["completion_tokens"] == 4 and root["attributes"]["ttft_ms"] >= 0
        # The worker was handed the attempt span as its parent, and the client's id.
        got = [h for h in seen if h.get("x-request-id") == "client-id-1"]
        assert got, seen
        ctx = tracing.parse_traceparent(got[0]["traceparent"])
        assert ctx is not None and (ctx.trace_id, ctx.span_id, ctx.sampled) == (root["trace_id"], attempt["span_id"], True)
        by_trace = (await http.get("/v1/traces", params={"trace_id": root["trace_id"]})).json()["data"]
        assert {s["span_id"] for s in by_trace} == {s["span_id"] for s in data["data"]}
        assert (await http.get("/v1/traces")).status_code == 400
        assert (await http.get("/v1/traces", params={"slowest": "many"})).status_code == 400
        # The error at the door is kept too, with its status.
        failed = (await http.get("/v1/traces", params={"request_id": "r2"})).json()["data"]
        assert [s["status"] for s in failed] == ["error"]


async def test_unsampled_migration_is_kept_with_both_workers(cluster: Cluster) -> None:
    tracing.tracer().sampler = Sampler(0.0)
    a = await cluster.add_worker(fail_after=2)
    b = await cluster.add_worker()
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as http:
        ids = []
        for i in range(2):  # round-robin: one of them starts on the failing worker
            rid = f"mig-{i}"
            r = await http.post("/v1/completions", json=_completion(6), headers={"x-request-id": rid})
            assert r.status_code == 200
            ids.append(rid)
        summary = (await http.get("/v1/traces", params={"slowest": "10"})).json()
    assert summary["object"] == "list"
    rows = {row["request_id"]: row for row in summary["requests"]}
    assert list(rows) == [rid for rid in ids if rid in rows] and len(rows) == 1  # only the migrated one was kept
    row = next(iter(rows.values()))
    assert row["migrated"] is True and row["status"] == "ok" and row["model"] == "tiny"
    assert row["worker_ids"] == [worker_id_hex(a.id), worker_id_hex(b.id)]
    assert row["duration_ms"] > 0 and row["ttft_ms"] is not None
    spans = tracing.tracer().ring.find(row["request_id"])
    migration = [s for s in spans if s.name == "migration"]
    assert len(migration) == 1
    assert migration[0].attributes["from_worker_id"] == worker_id_hex(a.id)
    assert migration[0].attributes["to_worker_id"] == worker_id_hex(b.id)
    # After the migration the new attempt records (and its traceparent says so to the worker).
    attempts = [s for s in spans if s.name == "client_request"]
    assert [s.attributes["worker_id"] for s in attempts] == [worker_id_hex(b.id)]


def test_output_parse_span_times_the_parser() -> None:
    from dynamod.daemon.frontend.parsers import ToolSettings, build_output_parser
    from dynamod.daemon.frontend.pipeline.tracing import parse_span
    from tests.unit.frontend.parsers.test_recorded_outputs import tool_specs
    from tests.unit.frontend.parsers.test_settings import TWO_CALLS

    settings = ToolSettings.from_request(tool_specs(["get_weather", "get_time"]), None, None)
    parser = build_output_parser(tool_call_parser_name="hermes", reasoning_parser_name=None, tools=settings)
    assert parser is not None
    tr = tracing.Tracer()
    root = tr.start_span("http-request", component="frontend", sampled=True, attributes={"request_id": "p", "model": "m"})
    parse_span(root, parser)  # nothing parsed yet: no span
    half = len(TWO_CALLS) // 2
    parser.feed(TWO_CALLS[:half])
    parser.finish(TWO_CALLS[half:])
    saved = tracing._TRACER
    tracing._TRACER = tr
    try:
        parse_span(root, parser)
    finally:
        tracing._TRACER = saved
    [span] = tr.ring.find("p")
    assert span.name == "output_parse" and span.parent_id == root.span_id
    assert span.attributes["tool_calls"] == 2 and span.attributes["tool_call_parser"]
    assert span.attributes["parse_ms"] > 0 and span.end_unix_ns > span.start_unix_ns
