"""The frontend's spans of one request, and the per-request summary ``GET /v1/traces`` lists.

    http-request (root: the whole HTTP request; Dynamo's name)
      preprocess       chat template + tokenize (the surface's plan)
      route            each routing decision; the router's explain numbers as attributes
      prefill          the remote prefill stage (its worker's handle_payload is a child)
      client_request   each decode/agg attempt on a worker (the worker's handle_payload is a child)
      migration        a broken stream re-sent to another worker (old and new worker)
      output_parse     tool-call / reasoning parsing of the output

The root is made unless tracing is off (the head sampling decision lives on it); its children
only when it records (``Tracer.child``). A failed or migrated request is recorded anyway
(``tracing``). With tracing off every helper here takes a None root and does nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from dynamod.daemon.frontend.http.asgi import Scope, header
from dynamod.shared.observability import tracing
from dynamod.shared.observability.tracing import Span
from dynamod.shared.protocol.worker_id import worker_id_hex

if TYPE_CHECKING:
    from dynamod.daemon.frontend.parsers.output import OutputParser
    from dynamod.daemon.frontend.pipeline.request import EngineRequest, FrontendRequest
    from dynamod.daemon.frontend.pipeline.routing import RouteChoice

COMPONENT = "frontend"
_TRACEPARENT_B = tracing.TRACEPARENT.encode("latin-1")

def ms_since(perf_start: float, now: float) -> float:
    """Milliseconds between two ``perf_counter`` readings, truncated to the microsecond: three
    decimals like ``round(x, 3)``, for half its cost (attributes of every sampled request)."""
    return int((now - perf_start) * 1e6) / 1000.0


def ms_between_ns(start_ns: int, end_ns: int) -> float:
    """Milliseconds between two nanosecond clock readings, to the microsecond."""
    return (end_ns - start_ns) // 1000 / 1000.0


def start_request_span(scope: Scope, request_id: str, endpoint: str) -> Span | None:
    """The root of a request's trace, continuing the client's ``traceparent`` when it sent one
    (sampled when the client sampled it, else by this process's sampler); None when tracing is off
    (then no span of the request is made and no ``traceparent`` is sent)."""
    tr = tracing.tracer()
    if not tr.enabled:
        return None
    attributes: dict[str, tracing.AttrValue] = {
        "request_id": request_id, "model": "", "role": COMPONENT, "endpoint": endpoint,
        "http.method": scope.get("method", ""),
    }
    client = header(scope, _TRACEPARENT_B)
    parent = tracing.parse_traceparent(client) if client is not None else None
    if parent is None:
        return tr.start_root(tracing.SPAN_HTTP_REQUEST, COMPONENT, attributes)
    return tr.start_span(
        tracing.SPAN_HTTP_REQUEST, component=COMPONENT, parent=parent,
        sampled=parent.sampled or tr.sampler.sampled(parent.trace_id), attributes=attributes,
    )


def finish_request_span(request: FrontendRequest[Any], status: str) -> None:
    """Ends the root with the request's outcome (its summary fields are attributes)."""
    span = request.trace
    if span is None or span.ended:
        return
    if not span.recording and status != "error" and span.status != tracing.STATUS_ERROR:
        span.end()  # not sampled, nothing to keep: skip the summary fields
        return
    # Direct writes rather than ``Span.set``: this runs for every sampled request.
    attrs = span.attributes
    attrs["status"] = status
    attrs["stream"] = request.stream
    attrs["duration_ms"] = ms_since(request.started_at, time.perf_counter())
    ttft = attrs.get("ttft_ms")
    if ttft is not None:  # kept unrounded until now (``serve``): an unsampled request never rounds it
        attrs["ttft_ms"] = int(ttft * 1000.0) / 1000.0  # type: ignore[operator]
    engine = request.engine
    if engine is not None:
        attrs["prompt_tokens"] = engine.prompt_len
        attrs["completion_tokens"] = len(engine.generated)
        attrs["cached_tokens"] = engine.cached_tokens
        if engine.finish_reason is not None:
            attrs["finish_reason"] = engine.finish_reason
        attrs["migrations"] = engine.migrations
        route = engine.decode_route
        if route is not None:
            attrs["worker_id"] = worker_id_hex(route.instance.instance_id)
        if engine.prefill_route is not None:
            attrs["prefill_worker_id"] = worker_id_hex(engine.prefill_route.worker_id)
    plan = request.plan
    if plan is not None and plan.parser is not None:
        parse_span(span, plan.parser)
    if status == "error" and span.status != tracing.STATUS_ERROR:
        span.fail("request failed")
    span.end()


def parse_span(root: Span, parser: OutputParser) -> None:
    """The tool-call / reasoning parsing of the output: from the first delta parsed to the last,
    with the time spent inside the parser and what it found."""
    if not parser.started_ns:
        return
    span = tracing.tracer().child(root, tracing.SPAN_OUTPUT_PARSE)
    if span is None:
        return
    reasoning, tools = parser.names
    span.start_unix_ns = parser.started_ns
    span.update({
        "parse_ms": round(parser.busy_ns / 1e6, 3), "reasoning_parser": reasoning, "tool_call_parser": tools,
        "tool_calls": len(parser.tool_calls),
    })
    span.end(max(parser.ended_ns or time.time_ns(), parser.started_ns + 1))


def note_worker(span: Span | None, worker_id: int) -> None:
    """Adds a worker to the root's ``worker_ids`` (comma-separated hex, in the order used)."""
    if span is None or not span.recording:
        return  # an unsampled root that is promoted later is given its workers by migration_span
    wid = worker_id_hex(worker_id)
    have = span.attributes.get("worker_ids")
    if not have:
        span.attributes["worker_ids"] = wid
    elif wid not in str(have).split(","):
        span.attributes["worker_ids"] = f"{have},{wid}"


def route_span(parent: Span | None, choice: RouteChoice, started_ns: int, stage: str) -> None:
    """Records one routing decision (a child of the request span) with the explain numbers."""
    span = tracing.tracer().child(parent, tracing.SPAN_ROUTE, stage=stage)
    if span is None:
        return
    span.start_unix_ns = started_ns
    attrs = span.attributes
    attrs["worker_id"] = worker_id_hex(choice.instance.instance_id)
    attrs["dp_rank"] = choice.dp_rank or 0
    attrs["overlap_blocks"] = choice.overlap_blocks
    explain = choice.explain
    if explain is not None:  # the explain dict is built here, for a sampled request only
        span.update(tracing.flat_attributes("router", explain.explain()))
        span.set("router.detail", explain.detail)
    if choice.session is not None:
        span.set("session.outcome", choice.session.outcome)
    span.end()


def migration_span(engine: EngineRequest, from_worker: int, error: BaseException) -> Span | None:
    """A migration is always recorded: the root is promoted, so the new attempt's spans (and its
    worker's) are kept too. Returns the span, to be ended once the new worker is chosen."""
    root = engine.trace
    if root is None:
        return None
    if not root.recording:
        root.promote()
        note_worker(root, from_worker)
    root.set("migrated", True)
    span = tracing.tracer().child(
        root, tracing.SPAN_MIGRATION, from_worker_id=worker_id_hex(from_worker), attempt=engine.migrations,
        generated_tokens=len(engine.generated), reason=f"{type(error).__name__}: {error}", migrated=True,
    )
    return span


def requests_summary(limit: int) -> list[dict[str, Any]]:
    """The ``limit`` slowest recent requests this frontend holds (``GET /v1/traces?slowest=N``),
    read from the ring's records (no span views made for the thousands it holds)."""
    rows = []
    for _, records in tracing.tracer().ring.records():
        for rec in reversed(records):  # the root ends last
            fields = tracing.record_fields(rec)
            if fields[3] == tracing.SPAN_HTTP_REQUEST and fields[4] == COMPONENT:
                rows.append(_summary(fields))
                break
    rows.sort(key=lambda r: r["duration_ms"], reverse=True)
    return rows[:limit]


def _summary(rec: list[Any]) -> dict[str, Any]:
    attrs = rec[9]
    ttft = attrs.get("ttft_ms")
    workers = str(attrs.get("worker_ids") or "")
    return {
        "request_id": str(attrs.get("request_id", "")),
        "trace_id": rec[0],
        "model": str(attrs.get("model", "")),
        "start_unix_ns": rec[6],
        "duration_ms": round((rec[7] - rec[6]) / 1e6, 3),
        "ttft_ms": float(ttft) if isinstance(ttft, int | float) and not isinstance(ttft, bool) else None,
        "status": rec[8],
        "worker_ids": [w for w in workers.split(",") if w],
        "migrated": bool(attrs.get("migrated", False)),
    }
