"""The tracing core: W3C traceparent, the span ring's bounds, head sampling, the span tree and the
propagation helpers the request plane uses."""

from __future__ import annotations

import pytest

from dynamod.shared.observability import tracing
from dynamod.shared.observability.tracing import (
    Sampler,
    SpanContext,
    SpanRing,
    Tracer,
    format_traceparent,
    parse_traceparent,
    valid_request_id,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_traceparent_round_trip_and_flags() -> None:
    ctx = parse_traceparent(f"00-{TRACE}-{PARENT}-01")
    assert ctx is not None and (ctx.trace_id, ctx.span_id, ctx.sampled) == (TRACE, PARENT, True)
    assert format_traceparent(ctx) == f"00-{TRACE}-{PARENT}-01"
    unsampled = parse_traceparent(f"00-{TRACE}-{PARENT}-00")
    assert unsampled is not None and not unsampled.sampled
    assert format_traceparent(unsampled).endswith("-00")
    # Other flag bits do not hide the sampled bit; a future version is read by its first fields.
    assert parse_traceparent(f"00-{TRACE}-{PARENT}-03").sampled  # type: ignore[union-attr]
    future = parse_traceparent(f"cc-{TRACE}-{PARENT}-01-extra")
    assert future is not None and future.trace_id == TRACE


@pytest.mark.parametrize(
    "value",
    [
        None, "", "garbage", f"00-{TRACE}-{PARENT}", f"00-{TRACE[:-1]}-{PARENT}-01", f"00-{TRACE}-{PARENT}0-01",
        f"00-{'0' * 32}-{PARENT}-01", f"00-{TRACE}-{'0' * 16}-01", f"ff-{TRACE}-{PARENT}-01",
        f"00-{TRACE}-{PARENT}-01-extra", f"00-{TRACE[:-1]}g-{PARENT}-01", f"00-{TRACE}-{PARENT}-1",
    ],
)
def test_malformed_traceparent_starts_a_new_trace(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_request_id_validation() -> None:
    assert valid_request_id("req-42_abc.DEF:1")
    assert valid_request_id("x" * 128)
    for bad in ("", "x" * 129, "tab\there", "new\nline", " padded", "ünïcode", "bell\x07"):
        assert not valid_request_id(bad), bad


def _span(tr: Tracer, request_id: str, name: str = "s", parent: tracing.Span | None = None) -> tracing.Span:
    span = tr.start_span(name, component="frontend", parent=parent, sampled=True, attributes={"request_id": request_id})
    span.end()
    return span


def test_ring_is_bounded_by_request_count() -> None:
    tr = Tracer(ring=SpanRing(max_requests=3, max_spans=100))
    roots = [_span(tr, f"r{i}") for i in range(5)]
    assert len(tr.ring) == 3
    assert tr.ring.find("r0") == [] and tr.ring.find("r1") == []
    assert [s.span_id for s in tr.ring.find("r4")] == [roots[4].span_id]
    # The trace index forgets evicted requests too.
    assert tr.ring.find(trace_id=roots[0].trace_id) == []
    assert tr.ring.find(trace_id=roots[3].trace_id)[0].span_id == roots[3].span_id


def test_ring_is_bounded_by_span_count() -> None:
    tr = Tracer(ring=SpanRing(max_requests=100, max_spans=10))
    for i in range(4):
        root = _span(tr, f"r{i}")
        for _ in range(3):
            _span(tr, f"r{i}", parent=root)
    assert tr.ring.span_count <= 10
    assert tr.ring.find("r0") == []  # the oldest request went first
    assert len(tr.ring.find("r3")) == 4
    # One request larger than the ring keeps its newest spans, within the bound.
    big = Tracer(ring=SpanRing(max_requests=10, max_spans=5))
    for _ in range(8):
        _span(big, "huge")
    assert big.ring.span_count == 5 and len(big.ring.find("huge")) == 5


def test_ring_find_limit_and_order() -> None:
    tr = Tracer()
    root = tr.start_span("root", component="frontend", sampled=True, attributes={"request_id": "q"}, start_unix_ns=100)
    child = tr.child(root, "child")
    assert child is not None
    child.start_unix_ns = 150
    child.end(200)
    root.end(300)
    spans = tr.ring.find("q")
    assert [s.name for s in spans] == ["root", "child"]  # by start time
    assert len(tr.ring.find("q", limit=1)) == 1
    assert tr.ring.find("q", trace_id="f" * 32) == []  # both given: the request's spans of that trace


def test_sampler_ratio_is_deterministic_per_trace() -> None:
    assert not Sampler(0.0).sampled(tracing.new_trace_id())
    assert Sampler(1.0).sampled(tracing.new_trace_id())
    quarter = Sampler(0.25)
    ids = [tracing.new_trace_id() for _ in range(20_000)]
    hits = sum(quarter.sampled(t) for t in ids)
    assert 0.22 * len(ids) < hits < 0.28 * len(ids)
    assert all(quarter.sampled(t) == quarter.sampled(t) for t in ids[:100])  # every process agrees
    with pytest.raises(ValueError):
        Sampler(1.5)


def test_span_tree_parents_and_inherited_attributes() -> None:
    tr = Tracer()
    root = tr.start_span(
        "http-request", component="frontend", sampled=True, attributes={"request_id": "t1", "model": "tiny"}
    )
    child = tr.child(root, "route", stage="agg")
    assert child is not None
    assert child.trace_id == root.trace_id and child.parent_id == root.span_id
    assert child.attributes == {"request_id": "t1", "model": "tiny", "stage": "agg"}
    # A remote side continues the trace from the propagated context.
    remote = tr.start_span("handle_payload", component="decode", parent=child.context, instance_id="1a")
    assert remote.parent_id == child.span_id and remote.recording
    child.end()
    remote.end()
    root.end()
    got = {s.span_id: s for s in tr.ring.find("t1")}
    assert set(got) == {root.span_id, child.span_id}  # the remote span had no request_id: keyed by trace
    assert tr.ring.find(trace_id=root.trace_id)[-1].name in ("handle_payload", "route", "http-request")
    as_dict = root.to_dict()
    assert as_dict["parent_id"] is None and len(as_dict["trace_id"]) == 32 and len(as_dict["span_id"]) == 16
    assert as_dict["end_unix_ns"] >= as_dict["start_unix_ns"] and as_dict["status"] == "ok"


def test_unsampled_request_keeps_errors_and_migrations() -> None:
    tr = Tracer(sampler=Sampler(0.0))
    quiet = tr.start_span("http-request", component="frontend", attributes={"request_id": "quiet"})
    assert not quiet.recording and tr.child(quiet, "route") is None
    quiet.end()
    assert tr.ring.find("quiet") == []
    failed = tr.start_span("http-request", component="frontend", attributes={"request_id": "failed"})
    failed.fail(RuntimeError("boom"))
    failed.end()
    [kept] = tr.ring.find("failed")
    assert kept.status == "error" and kept.attributes["error"] == "RuntimeError: boom"
    migrated = tr.start_span("http-request", component="frontend", attributes={"request_id": "moved"})
    migrated.promote()
    span = tr.child(migrated, "migration")
    assert span is not None
    span.end()
    migrated.end()
    assert {s.name for s in tr.ring.find("moved")} == {"http-request", "migration"}
    # The propagated context tells the next worker to record from now on.
    assert migrated.context.sampled


def test_outgoing_headers_carry_the_current_span() -> None:
    tr = Tracer()
    assert tracing.outgoing_headers(None) is None
    span = tr.start_span("client_request", component="frontend", sampled=True, attributes={"request_id": "abc"})
    with tracing.use_span(span):
        headers = tracing.outgoing_headers({"x": "1"})
    assert headers is not None and headers["x"] == "1"
    assert headers["x-request-id"] == "abc"
    ctx = tracing.headers_context(headers)
    assert isinstance(ctx, SpanContext) and (ctx.trace_id, ctx.span_id, ctx.sampled) == (span.trace_id, span.span_id, True)
    assert tracing.headers_request_id(headers) == "abc"
    assert tracing.current_span() is None  # restored on leaving
    # A caller's own traceparent wins; a bad x-request-id from a peer is not believed.
    with tracing.use_span(span):
        assert tracing.outgoing_headers({"traceparent": "mine"}) == {"traceparent": "mine"}
    assert tracing.headers_request_id({"x-request-id": "bad\nid"}) is None


def test_exporter_failure_does_not_lose_the_ring() -> None:
    tr = Tracer()

    def broken(_span: tracing.Span) -> None:
        raise RuntimeError("collector bug")

    tr.exporter = broken
    _span(tr, "kept")
    assert len(tr.ring.find("kept")) == 1


def test_log_lines_carry_the_request_id() -> None:
    import json
    import logging

    from dynamod.shared.observability.logging import REQUEST_ID, _JsonFormatter, _KvFormatter

    record = logging.LogRecord("dynamod.test", logging.INFO, __file__, 1, "request migrating worker=%s", ("1a",), None)
    assert "x_request_id" not in _KvFormatter().format(record)
    token = REQUEST_ID.set("client-7")
    try:
        line = _KvFormatter().format(record)
        obj = json.loads(_JsonFormatter().format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line.endswith("request migrating worker=1a x_request_id=client-7")
    assert obj["x_request_id"] == "client-7" and obj["msg"] == "request migrating worker=1a"


def test_sample_rate_parsing_accepts_off() -> None:
    from dynamod.shared.observability.tracing_setup import parse_sample_rate

    assert parse_sample_rate("off") == parse_sample_rate(" OFF ") == tracing.TRACING_OFF
    assert parse_sample_rate("0") == 0.0 and parse_sample_rate("0.01") == 0.01
    for bad in ("1.5", "-0.1", "none", ""):
        with pytest.raises(ValueError, match="sample rate"):
            parse_sample_rate(bad)


@pytest.fixture
def tracing_off(monkeypatch: pytest.MonkeyPatch) -> Tracer:
    """The process tracer swapped for one configured ``off`` (the real one is left as it was)."""
    from dynamod.shared.observability import tracing_setup

    tr = Tracer()
    monkeypatch.setattr(tracing, "_TRACER", tr)
    monkeypatch.setattr(tracing_setup, "tracer", lambda: tr)
    assert tracing_setup.configure("off", export=False) is tr
    return tr


def test_tracing_off_keeps_nothing_and_sends_no_traceparent(tracing_off: Tracer) -> None:
    from dynamod.daemon.frontend.pipeline.tracing import migration_span, start_request_span

    tr = tracing_off
    assert not tr.enabled and tr.exporter is None
    scope = {"type": "http", "method": "POST", "headers": [(b"traceparent", f"00-{TRACE}-{PARENT}-01".encode())]}
    # The frontend makes no root, even for a client that sampled its trace.
    assert start_request_span(scope, "rid-1", "chat_completions") is None
    with tracing.use_span(None):
        assert tracing.outgoing_headers({"x": "1"}) == {"x": "1"}
        # The request's x-request-id (its log lines' id) still reaches the workers, without a traceparent.
        from dynamod.shared.observability.logging import REQUEST_ID

        token = REQUEST_ID.set("rid-1")
        try:
            assert tracing.outgoing_headers({"x": "1"}) == {"x": "1", "x-request-id": "rid-1"}
            assert tracing.outgoing_headers(None) == {"x-request-id": "rid-1"}
            assert tracing.outgoing_headers({"x-request-id": "own"}) == {"x-request-id": "own"}
        finally:
            REQUEST_ID.reset(token)
    # A worker's span (made from no traceparent) is unsampled and not kept, even when it fails.
    span = tr.start_span("handle_payload", component="agg", attributes={"request_id": "rid-1"})
    assert not span.recording
    span.fail(RuntimeError("boom"))
    span.end()
    assert len(tr.ring) == 0 and tr.ring.find("rid-1") == []

    class _Engine:
        trace = None

    assert migration_span(_Engine(), 1, RuntimeError("gone")) is None  # type: ignore[arg-type]
    # Switching back on (configure again) records again.
    from dynamod.shared.observability import tracing_setup

    tracing_setup.configure(1.0, export=False)
    assert tr.enabled and start_request_span({"type": "http", "headers": []}, "rid-2", "chat_completions") is not None


def test_traces_endpoint_says_tracing_is_off(tracing_off: Tracer) -> None:
    import json

    from dynamod.daemon.frontend.app import traces_reply

    status, body = traces_reply("slowest=5")
    reply = json.loads(body)
    assert status == 200 and reply["requests"] == [] and "off" in reply["note"]
    status, body = traces_reply("request_id=abc")
    reply = json.loads(body)
    assert status == 200 and reply["data"] == [] and "off" in reply["note"]
    tracing_off.enabled = True
    assert "note" not in json.loads(traces_reply("slowest=5")[1])
