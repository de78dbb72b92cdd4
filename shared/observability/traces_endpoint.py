"""The ``traces`` control endpoint every worker role serves (workers, the standalone router, encode
workers): the spans this process's ring buffer holds for a request (its ``x-request-id``) or a
trace. One handler, registered beside each role's other control endpoints."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from dynamod.shared.errors import InvalidRequestError
from dynamod.shared.observability import tracing
from dynamod.shared.protocol import control
from dynamod.shared.transport.plane import RequestContext


async def serve_traces(body: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    req = control.parse_body(body, control.TracesRequest, control.TRACES)
    if req.limit < 0:
        raise InvalidRequestError(f"limit must be at least 0, got {req.limit}")
    spans = tracing.tracer().ring.find(req.request_id, req.trace_id, req.limit)
    yield control.ok(f"{len(spans)} spans", spans=tracing.spans_as_dicts(spans))
